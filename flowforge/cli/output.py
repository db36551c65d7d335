"""Rendering command output: aligned text tables for people, JSON for scripts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

from flowforge.views import attempt_dict, dumps, run_dict, task_dict, to_dict

__all__ = ["attempt_dict", "emit_json", "run_dict", "table", "task_dict", "to_dict"]


def emit_json(data: Any, out: TextIO = sys.stdout) -> None:
    out.write(dumps(data) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO = sys.stdout) -> None:
    """Print an aligned table; ``-`` stands for an empty cell."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
