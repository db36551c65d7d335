"""Paging a map's items, the pure parts: the opaque cursor (only what :func:`item_cursor` wrote
is accepted), the state filter and page size (every bad value an InputError naming the flag or
parameter), the CLI's item cell, and ``flowforge items`` refusing bad flags before it connects.
"""

from __future__ import annotations

import base64
import io
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.items import ITEM_WIDTH, item_text
from flowforge.cli.main import main
from flowforge.domain.maps import (
    MAX_ITEM_INDEX,
    MAX_ITEMS_PAGE,
    cursor_index,
    item_cursor,
    item_state,
    page_limit,
)
from flowforge.domain.states import TaskState
from flowforge.errors import InputError


@pytest.mark.parametrize("index", [0, 1, 99, 9_999, 999_999, MAX_ITEM_INDEX])
def test_a_cursor_names_the_index_it_was_made_from(index: int) -> None:
    cursor = item_cursor(index)
    assert cursor_index(cursor) == index
    assert "=" not in cursor and cursor.isascii()  # travels in a query string as is
    assert str(index) not in cursor  # opaque: no client reads an index out of it


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x",
        "!!!!",
        "\x00",
        "\x1b[2J",
        "é",
        item_cursor(5) + "==",  # padded
        item_cursor(5) + "!",  # a character the decoder would skip
        " " + item_cursor(5),
        _b64("item:"),
        _b64("item:-1"),
        _b64("item:+5"),
        _b64("item: 5"),
        _b64("item:05"),  # not what the encoder writes
        _b64("item:\u0665"),  # a digit (ARABIC-INDIC FIVE), but not an ASCII one
        _b64(f"item:{MAX_ITEM_INDEX + 1}"),
        _b64("item:" + "9" * 400),
        _b64("5"),
        _b64("run:5"),
        base64.urlsafe_b64encode(b"2026-01-01T00:00:00+00:00|0").decode(),  # a runs cursor
        base64.urlsafe_b64encode(b"item:\xff").decode(),
    ],
)
def test_anything_else_is_a_malformed_cursor_naming_the_flag(bad: str) -> None:
    with pytest.raises(InputError, match=r"^--cursor is malformed"):
        cursor_index(bad, "--cursor")


def test_a_state_filter_is_a_task_state_in_any_case() -> None:
    assert item_state(None) is None
    assert item_state("dead") is TaskState.DEAD
    assert item_state("Succeeded") is TaskState.SUCCEEDED
    assert item_state(TaskState.READY) is TaskState.READY


@pytest.mark.parametrize("bad", ["", "nope", "SCHEDULED", "DEAD ", "\u017fucceeded", "dead\x00"])
def test_anything_else_is_not_a_state(bad: str) -> None:
    with pytest.raises(InputError, match=r"^--state must be one of PENDING, READY"):
        item_state(bad, "--state")


@pytest.mark.parametrize("good", [1, 100, MAX_ITEMS_PAGE])
def test_a_page_holds_from_one_to_the_bound(good: int) -> None:
    assert page_limit(good) == good


@pytest.mark.parametrize("bad", [0, -1, MAX_ITEMS_PAGE + 1, True, 2.0, "5", None])
def test_a_page_size_out_of_range_or_not_an_integer_is_refused(bad: Any) -> None:
    with pytest.raises(InputError, match=rf"^limit must be an integer from 1 to {MAX_ITEMS_PAGE}"):
        page_limit(bad)


def test_an_item_cell_is_compact_json_cut_to_its_width() -> None:
    assert item_text(5) == "5"
    assert item_text({"path": "a/b", "n": [1, 2]}) == '{"path":"a/b","n":[1,2]}'
    assert item_text("café") == '"café"'
    long = item_text({"path": "x" * 100})
    assert len(long) == ITEM_WIDTH and long.endswith("…")
    assert item_text("x" * (ITEM_WIDTH - 2)) == '"' + "x" * (ITEM_WIDTH - 2) + '"'  # fits
    # a control character is JSON-escaped; the table escapes what JSON leaves (C1, bidi)
    assert "\x1b" not in item_text("\x1b[2J")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--limit", "0"], "--limit must be an integer from 1 to 500"),
        (["--limit", "501"], "--limit must be an integer from 1 to 500"),
        (["--state", "later"], "--state must be one of"),
        (["--cursor", "abc"], "--cursor is malformed"),
    ],
)
def test_items_refuses_bad_flags_before_it_connects(flags: list[str], message: str) -> None:
    err, out = io.StringIO(), io.StringIO()
    # no config, no database: the flags are judged before either is looked at
    with redirect_stderr(err), redirect_stdout(out):
        code = main(["items", "00000000-0000-0000-0000-000000000000", *flags])
    assert code == exitcodes.USAGE
    assert err.getvalue().startswith(f"flowforge: {message}")
    assert len(err.getvalue().splitlines()) == 1 and out.getvalue() == ""
