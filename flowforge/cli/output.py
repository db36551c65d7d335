"""Rendering command output: aligned text tables for people, JSON for scripts.

Everything the CLI prints as text goes through :func:`escape` here (table cells, one-line
messages, error lines): stored text — a handler's error, a workflow name, a reason — may hold
terminal escape sequences or line breaks, which would recolour, move or rewrite what the
operator reads. JSON output needs no escaping: ``json.dumps`` escapes every control and
non-ASCII character by construction.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

from flowforge.text import escape
from flowforge.views import attempt_dict, dumps, run_dict, stats_dict, task_dict, to_dict

__all__ = [
    "attempt_dict",
    "block",
    "dumps",
    "emit_json",
    "escape",
    "first_line",
    "line",
    "one_line",
    "run_dict",
    "stats_dict",
    "table",
    "task_dict",
    "to_dict",
]


def one_line(text: str) -> str:
    """A message as one line: runs of blanks and line breaks become one space, then escaped."""
    return escape(" ".join(text.split()))


def line(text: str, out: TextIO = sys.stdout) -> None:
    """Print one escaped line (the text may come from the database or the command line)."""
    out.write(escape(text) + "\n")


def emit_json(data: Any, out: TextIO = sys.stdout) -> None:
    out.write(dumps(data) + "\n")


def first_line(text: str | None) -> str | None:
    """The first non-blank line of ``text`` (a stored error), whole; None for no text."""
    if not text:
        return None
    # split at line feeds only: a carriage return inside a line is shown escaped, not obeyed
    return next((ln.strip() for ln in text.split("\n") if ln.strip()), "")


def block(text: str, out: TextIO = sys.stdout, indent: str = "  ") -> None:
    """Print multi-line stored text (an error, a traceback) line by line, each escaped and
    indented, so no line can pass for the command's own output."""
    for text_line in text.rstrip("\n").split("\n"):
        out.write(indent + escape(text_line.rstrip()) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.3f}"
    return escape(str(value))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO = sys.stdout) -> None:
    """Print an aligned table; ``-`` stands for an empty cell."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
