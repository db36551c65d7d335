"""Rendering command output: aligned text tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any, TextIO
from uuid import UUID

from flowforge.domain.model import Attempt, Run, TaskRun


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID | Enum):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def emit_json(data: Any, out: TextIO = sys.stdout) -> None:
    out.write(json.dumps(data, default=_default, sort_keys=False) + "\n")


def to_dict(value: Any) -> Any:
    """A dataclass (or list of them) as plain JSON-ready data."""
    if isinstance(value, list | tuple):
        return [to_dict(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


def task_dict(task: TaskRun) -> dict[str, Any]:
    data = to_dict(task)
    data["duration_s"] = _duration(task.started_at, task.finished_at)
    return data  # type: ignore[no-any-return]


def run_dict(run: Run, with_tasks: bool = True) -> dict[str, Any]:
    """The ``status --json`` / API shape: ``{"id", "workflow", "state", "tasks": [...]}``."""
    data = {k: v for k, v in to_dict(run).items() if k != "tasks"}
    if with_tasks:
        data["tasks"] = [task_dict(t) for t in run.tasks]
    return data


def attempt_dict(attempt: Attempt) -> dict[str, Any]:
    data = to_dict(attempt)
    data["duration_s"] = _duration(attempt.started_at, attempt.finished_at)
    return data  # type: ignore[no-any-return]


def _duration(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


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
