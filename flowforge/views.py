"""JSON shapes of the read models — one definition for the CLI and the HTTP api."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any
from uuid import UUID

from flowforge.domain.breakers import Breaker, GateChange, Pause
from flowforge.domain.control import Controlled, HoldKind, KeyHold
from flowforge.domain.model import (
    Attempt,
    EventSent,
    FireRecord,
    ManualFire,
    MapPage,
    Overview,
    PoisonCandidate,
    QueueLoad,
    RetryBacklog,
    Run,
    ScheduleInfo,
    Stats,
    TaskRun,
)
from flowforge.domain.output import AttemptLog


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID | Enum):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


#: ``json.dumps(data, default=_default)``'s encoder, made once: json.dumps builds one per call.
_ENCODER = json.JSONEncoder(default=_default)


def dumps(data: Any) -> str:
    """JSON text of ``data`` (datetimes as ISO 8601, UUIDs and enums as strings)."""
    return _ENCODER.encode(data)


def to_dict(value: Any) -> Any:
    """A dataclass (or a list of them) as plain data."""
    if isinstance(value, list | tuple):
        return [to_dict(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(value)
    return value


#: Types whose values :func:`_plain` returns as they are, tested first by exact type: most
#: fields of a read model are one of these.
_LEAVES = frozenset({str, int, float, bool, type(None), datetime, UUID})


#: :func:`_field_names` by type, filled as types are met (a few dozen read models).
_NAMES: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    """The field names of the dataclass ``cls``, None for any other type (``fields`` and
    ``is_dataclass`` at every value were a third of run_dict's time)."""
    if cls not in _NAMES:
        _NAMES[cls] = tuple(f.name for f in fields(cls)) if is_dataclass(cls) else None
    return _NAMES[cls]


def _plain(value: Any) -> Any:
    """What :func:`dataclasses.asdict` makes of ``value`` — dataclasses as dicts, containers
    copied — without deep-copying the values in them, every one immutable here (text, numbers,
    times, ids, enums): asdict's copies were a tenth of an api request's CPU (docs/performance.md,
    "Submitting work")."""
    kind = type(value)
    if kind in _LEAVES:
        return value
    names = _field_names(kind)
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        items = [_plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def duration_s(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


def task_dict(task: TaskRun) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(task)
    data["duration_s"] = duration_s(task.started_at, task.finished_at)
    return data


def run_dict(run: Run, with_tasks: bool = True) -> dict[str, Any]:
    """The ``status --json`` / ``GET /api/v1/runs/{id}`` shape."""
    names = _field_names(type(run)) or ()
    data = {name: _plain(getattr(run, name)) for name in names if name != "tasks"}
    if with_tasks:
        data["tasks"] = [task_dict(t) for t in run.tasks]
        # what was compensated for a failure: run_if: any_failed steps that succeeded
        data["compensated"] = list(run.compensated)
    return data


def attempt_log_dict(log: AttemptLog) -> dict[str, Any]:
    """The ``flowforge logs --json`` / ``GET /api/v1/task-runs/{id}/logs`` shape: the attempt
    (null: none yet) and ``attempts`` so far, ``running``, the kept ``output`` (the tail) and
    ``dropped_bytes`` before it; ``total_bytes`` is everything it wrote (a follower prints what
    lies past the total it printed)."""
    text, dropped = log.output.text, log.output.dropped
    return {
        "task_run_id": log.task_run_id,
        "task_state": log.task_state,
        "attempt": log.attempt,
        "attempts": log.attempts,
        "outcome": log.outcome,
        "started_at": log.started_at,
        "finished_at": log.finished_at,
        "running": log.attempt is not None and log.finished_at is None,
        "output": text,
        "dropped_bytes": dropped,
        "total_bytes": dropped + len(text.encode("utf-8")),
    }


def attempt_dict(attempt: Attempt) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(attempt)
    data["duration_s"] = duration_s(attempt.started_at, attempt.finished_at)
    return data


def retry_backlog_dict(backlog: RetryBacklog) -> dict[str, Any]:
    return {"n": backlog.n, "next_at": backlog.next_at, "latest_at": backlog.latest_at}


def poison_dict(candidate: PoisonCandidate) -> dict[str, Any]:
    return {
        "id": candidate.id,
        "run_id": candidate.run_id,
        "name": candidate.name,
        "handler": candidate.handler,
        "state": candidate.state,
        "attempt": candidate.attempt,
        "failure_reason": candidate.failure_reason,
        "workflow": candidate.workflow,
    }


def overview_dict(overview: Overview) -> dict[str, Any]:
    """The ``GET /api/v1/overview`` shape (docs/dashboard-contract.md), without the request's
    ``poison_threshold`` and ``fresh_s``."""
    return {
        "runs": dict(overview.runs),
        "tasks": dict(overview.tasks),
        "finished_per_minute": [
            {"minute": m.minute, "succeeded": m.succeeded, "dead": m.dead, "cancelled": m.cancelled}
            for m in overview.finished_per_minute
        ],
        "retry_backlog": retry_backlog_dict(overview.retry_backlog),
        "poison_candidates": [poison_dict(p) for p in overview.poison_candidates],
        "dead_by_reason": dict(overview.dead_by_reason),
        "outbox": {"pending": overview.outbox.pending, "oldest_s": overview.outbox.oldest_s},
        "processes": [{"host": p.host, "role": p.role, "n": p.n} for p in overview.processes],
        **queues_dict(overview.queues),
        # the states whose count is PostgreSQL's estimate: more than 100,000 of them
        "estimated": {
            "runs": sorted(overview.estimated_runs),
            "tasks": sorted(overview.estimated_tasks),
        },
    }


def queues_dict(queues: Sequence[QueueLoad]) -> dict[str, Any]:
    """``queues``: READY tasks and live consumers per queue; ``unserved_queues``: the named
    queues among them with READY tasks and no live consumer (a warning, not an error)."""
    return {
        "queues": [
            {"queue": q.queue, "ready": q.ready, "consumers": q.consumers, "estimated": q.estimated}
            for q in queues
        ],
        "unserved_queues": [q.queue for q in queues if q.unserved],
    }


def stats_dict(stats: Stats) -> dict[str, Any]:
    """The ``flowforge stats --json`` shape."""
    return {
        "attempts": dict(stats.attempts),
        "attempts_estimated": stats.attempts_estimated,
        "failure_reasons": dict(stats.failure_reasons),
        "retry_backlog": retry_backlog_dict(stats.retry_backlog),
        "poison_candidates": [poison_dict(p) for p in stats.poison_candidates],
        "dead": [
            {"workflow": d.workflow, "handler": d.handler, "reason": d.reason, "n": d.n}
            for d in stats.dead
        ],
        "dead_newest_only": stats.dead_newest_only,
        **queues_dict(stats.queues),
    }


def fire_dict(record: FireRecord) -> dict[str, Any]:
    """One decision about a fire time: ``outcome`` created (``run_id``) or skipped for
    ``reason``; a skipped span runs from ``fire_time`` to ``last_fire_time``."""
    return {
        "fire_time": record.fire_time,
        "last_fire_time": record.last_fire_time,
        "outcome": record.outcome,
        "reason": record.reason,
        "manual": record.manual,
        "run_id": record.run_id,
        "decided_at": record.decided_at,
    }


def schedule_dict(info: ScheduleInfo) -> dict[str, Any]:
    """The ``flowforge schedules list --json`` / ``GET /api/v1/schedules`` shape of one
    schedule (docs/schedules.md)."""
    spec = dict(info.spec)
    timetable = f"cron {spec['cron']}" if spec.get("cron") else f"every {spec.get('every')}"
    return {
        "name": info.name,
        "workflow": info.workflow,
        "state": info.state,
        "timetable": timetable,
        "timezone": spec.get("timezone", "UTC"),
        "spec": spec,
        "next_fire_at": info.next_fire_at,
        "last_fire_at": info.last_fire_at,
        "last_run": (
            None
            if info.last_run_id is None
            else {"id": info.last_run_id, "state": info.last_run_state}
        ),
        "last_decision": None if info.last_decision is None else fire_dict(info.last_decision),
        "paused_at": info.paused_at,
        "retired_at": info.retired_at,
    }


def event_dict(sent: EventSent) -> dict[str, Any]:
    """A sent event and what it woke (the API's and ``flowforge event send --json``'s)."""
    return {
        "id": sent.id,
        "name": sent.name,
        "key": sent.key,
        "created_at": sent.created_at,
        "woke": [
            {"run_id": w.run_id, "task_run_id": w.task_run_id, "task": w.task} for w in sent.woke
        ],
    }


def manual_fire_dict(fired: ManualFire) -> dict[str, Any]:
    """``flowforge schedules trigger --json`` / ``POST /api/v1/schedules/{name}/trigger``."""
    return {"schedule": fired.schedule, "run_id": fired.run_id, "fire_time": fired.fire_time}


def map_page_dict(page: MapPage) -> dict[str, Any]:
    """A map's items counted by state, then a page of them (``GET
    /api/v1/task-runs/{id}/items`` and ``flowforge items --json``): ``{"task", "counts",
    "items", "next_cursor"}``."""
    return {
        "task": task_dict(page.task),
        "counts": dict(page.counts),
        "items": to_dict(list(page.items)),
        "next_cursor": page.next_cursor,
    }


def controlled_dict(done: Controlled) -> dict[str, Any]:
    """What a cancel, retry-now or bury did (API answer, ``--json``): ``{"action",
    "previous_state", "effect" ("now" or "stop": asked to stop, still RUNNING), "task"}``."""
    return {
        "action": str(done.action),
        "previous_state": str(done.previous_state),
        "effect": str(done.effect),
        "task": task_dict(done.task),
    }


def key_holds_dict(key: str, holds: Sequence[KeyHold]) -> dict[str, Any]:
    """``GET /api/v1/keys?key=`` / ``keys show --json``: ``{"key", "holds": [{"kind", "limit",
    "holders", "waiting", "next"}]}`` — one entry per kind of limit the key is (``ordering``,
    ``concurrency``, ``rate_limit``: the last also has ``per_s`` and ``started``); empty when
    nothing holds it."""
    rate_only = ("per_s", "started")
    return {
        "key": key,
        "holds": [
            {
                k: v
                for k, v in to_dict(h).items()
                if k != "key" and (h.kind is HoldKind.RATE_LIMIT or k not in rate_only)
            }
            for h in holds
        ],
    }


def breaker_dict(breaker: Breaker) -> dict[str, Any]:
    """A breaker (``GET /api/v1/breakers``, ``breakers list --json``)."""
    data: dict[str, Any] = to_dict(breaker)
    return data


def pause_dict(pause: Pause) -> dict[str, Any]:
    """A paused queue or handler (``GET /api/v1/pauses``, ``pause list --json``)."""
    data: dict[str, Any] = to_dict(pause)
    return data


def gate_change_dict(done: GateChange) -> dict[str, Any]:
    """What a breaker or pause action did (its API answer, ``--json``): a breaker's names its
    ``key`` (null: the handler's own breaker); a pause's has none."""
    data: dict[str, Any] = to_dict(done)
    if not done.action.startswith("breaker"):
        del data["key"]
    return data
