"""JSON shapes of runs, task runs and attempts — one definition for the CLI and the HTTP api."""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any
from uuid import UUID

from flowforge.domain.model import Attempt, Run, TaskRun


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID | Enum):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def dumps(data: Any) -> str:
    """JSON text of ``data`` (datetimes as ISO 8601, UUIDs and enums as strings)."""
    return json.dumps(data, default=_default)


def to_dict(value: Any) -> Any:
    """A dataclass (or a list of them) as plain data."""
    if isinstance(value, list | tuple):
        return [to_dict(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


def duration_s(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


def task_dict(task: TaskRun) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(task)
    data["duration_s"] = duration_s(task.started_at, task.finished_at)
    return data


def run_dict(run: Run, with_tasks: bool = True) -> dict[str, Any]:
    """The ``status --json`` / ``GET /api/v1/runs/{id}`` shape."""
    data = {k: v for k, v in to_dict(run).items() if k != "tasks"}
    if with_tasks:
        data["tasks"] = [task_dict(t) for t in run.tasks]
    return data


def attempt_dict(attempt: Attempt) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(attempt)
    data["duration_s"] = duration_s(attempt.started_at, attempt.finished_at)
    return data
