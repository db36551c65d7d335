"""Durations as people write them: ``45s``, ``30m``, ``12h``, ``90d``.

One parser for every place a duration is typed (``flowforge purge --older-than``, and later
schedules, delays and timeouts in SPEC 7.2): a positive whole number and one unit, no spaces,
no mixing (``1h30m`` is refused: write ``90m``).
"""

from __future__ import annotations

import re

#: Seconds per unit letter.
UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
_DURATION = re.compile(r"([0-9]{1,9})([smhd])")


def parse_duration(text: str) -> float:
    """The number of seconds ``text`` names; :class:`ValueError` (one line) if it is not one."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: a whole number and a unit, e.g. 90d, 12h, 30m, 45s"
        )
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds == 0:
        raise ValueError(f"{text!r} is not a duration: it must be longer than zero")
    return float(seconds)
