"""The one duration parser (``90d``, ``12h``, ``30m``, ``45s``): what it accepts and refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowforge.durations import UNITS, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("45s", 45.0), ("30m", 1800.0), ("12h", 43_200.0), ("90d", 7_776_000.0), ("1s", 1.0)],
)
def test_a_number_and_a_unit_is_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "90",  # no unit
        "d",  # no number
        "0d",  # not longer than zero
        "-5m",
        "1.5h",
        "1h30m",  # one unit only
        " 90d",
        "90d ",
        "90 d",
        "90D",
        "90w",
        "\u0669\u0660d",  # Arabic-Indic digits are digits to str.isdigit, not to a duration
        "1234567890s",  # more than nine digits
        "9\x00d",
        "1\x1b[31md",
    ],
)
def test_anything_else_is_one_line_value_error_that_names_it_escaped(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(text)
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message and "\x00" not in message
    assert repr(text) in message


@given(st.integers(min_value=1, max_value=999_999_999), st.sampled_from(sorted(UNITS)))
def test_every_well_formed_duration_round_trips(number: int, unit: str) -> None:
    assert parse_duration(f"{number}{unit}") == number * UNITS[unit]
