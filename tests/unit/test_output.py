"""``flowforge.cli.output``: nothing stored can act on the operator's terminal."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

from flowforge.cli import output

CONTROLS = [chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))]
BIDI = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]


def is_safe(text: str) -> bool:
    return not any(c in CONTROLS or c in BIDI or c in "\u2028\u2029" for c in text)


def test_every_c0_c1_and_del_character_is_escaped() -> None:
    for char in CONTROLS + BIDI:
        escaped = output.escape(f"a{char}b")
        assert is_safe(escaped) and escaped.startswith("a\\") and escaped.endswith("b"), char
    assert output.escape("\x1b[2J\n\t\r") == "\\x1b[2J\\n\\t\\r"
    assert output.escape("\x9b") == "\\x9b" and output.escape("\u202e") == "\\u202e"
    # a lone surrogate (an undecodable byte of the command line) would make the write fail
    assert output.escape("a\udcffb") == "a\\udcffb"


def test_printable_text_is_unchanged() -> None:
    text = "état ünïcode 中文 emoji 🙂 C:\\path 100% <b>"
    assert output.escape(text) == text


@given(st.text())
def test_any_text_becomes_one_safe_line(text: str) -> None:
    for render in (output.escape, output.one_line):
        assert is_safe(render(text))


@given(st.lists(st.lists(st.text(max_size=20), min_size=2, max_size=2), max_size=5))
def test_a_table_has_exactly_one_line_per_row(rows: list[list[str]]) -> None:
    out = io.StringIO()
    output.table(("A", "B"), rows, out)
    assert is_safe(out.getvalue().replace("\n", ""))
    assert out.getvalue().count("\n") == len(rows) + 1


def test_a_block_keeps_line_breaks_and_escapes_the_rest() -> None:
    out = io.StringIO()
    output.block("one\x1b[31m\nt\rwo\n", out)
    assert out.getvalue() == "  one\\x1b[31m\n  t\\rwo\n"


def test_first_line_is_whole() -> None:
    assert output.first_line("\n  " + "x" * 500 + "\r\nsecond") == "x" * 500
    assert output.first_line(None) is None and output.first_line("") is None
