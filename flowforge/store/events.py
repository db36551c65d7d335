"""Events (``wait_for_event``): sending one, and the scheduler's passes over waiting tasks.

A send and the start of a wait for the same name and key are serialised by one advisory lock
(``lock_event_key``), taken in a statement of its own before the statement that reads: under
READ COMMITTED each statement sees what committed before it began, so whichever of the two
commits first, the other sees it — an event is never stored unseen by a wait that started
meanwhile, nor a wait started unseen by an event sent meanwhile. See docs/dynamic.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flowforge.domain import transitions
from flowforge.domain.events import check_event
from flowforge.domain.model import EventSent
from flowforge.domain.states import TaskState
from flowforge.store import rows
from flowforge.store.part import Part, Tx

logger = logging.getLogger(__name__)


class Events(Part):
    """Sending events; starting, waking and expiring waits; purging old events."""

    def send_event(self, name: str, key: str, data: Any = None) -> EventSent:
        """Store an event and wake every task waiting for ``name`` and ``key`` (each once: a
        delivery row per task, keyed by the task). ``data`` (any JSON value, or None) becomes
        each woken task's result. Bad input raises :class:`~flowforge.errors.InputError`
        before any SQL runs; nothing is stored then."""
        name, key, stored = check_event(name, key, data)
        transitions.check(TaskState.RUNNING, TaskState.SUCCEEDED)
        params = {"name": name, "key": key, "data": None if stored is None else rows.jsonb(stored)}
        return self._transaction(_send, params)

    def start_event_waits(self, limit: int, retention_s: float) -> int:
        """Event waits whose dependencies are met start: PENDING → RUNNING with their timeout
        as ``wake_at`` (no lease, no outbox row), or PENDING → SUCCEEDED at once when a
        matching event not older than ``retention_s`` seconds is stored (the oldest one).
        Returns how many started."""
        transitions.check(TaskState.PENDING, TaskState.RUNNING)
        transitions.check(TaskState.PENDING, TaskState.SUCCEEDED)
        return self._transaction(_start, limit, retention_s)

    def expire_event_waits(self, limit: int) -> int:
        """Waits whose timeout passed (``wake_at <= now()``) with no event: RUNNING → DEAD
        ``event_timeout``. Returns how many."""
        transitions.check(TaskState.RUNNING, TaskState.DEAD)
        expired = self._query("expire_event_waits", {"limit": limit})
        for row in expired:  # one statement, committed: log after it
            logger.warning(
                "task %s of run %s: no event %s arrived before its timeout (DEAD event_timeout)",
                row["name"],
                row["run_id"],
                row["event_name"],
                extra={"action": "event_timeout", "task_run_id": str(row["id"])},
            )
        return len(expired)

    def purge_events(self, age_s: float, limit: int) -> int:
        """Delete up to ``limit`` events older than ``age_s`` seconds; returns how many."""
        return self._transaction(_purge, age_s, limit)


def _send(tx: Tx, params: Mapping[str, Any]) -> EventSent:
    tx.all("lock_event_key", params)
    return rows.event_sent(params["name"], params["key"], tx.all("deliver_event", params))


def _start(tx: Tx, limit: int, retention_s: float) -> int:
    locked = tx.all("lock_event_starts", {"limit": limit})
    if not locked:
        return 0
    tx.all("lock_event_keys", {"keys": sorted({r["lock_key"] for r in locked})})
    row = tx.one(
        "start_event_waits", {"ids": [r["id"] for r in locked], "retention_s": retention_s}
    )
    if row is None:
        return 0
    if row["queued"]:
        tx.all("notify_outbox")
    if row["delivered"]:
        tx.all("notify_scheduler")  # propagate derives the runs of the waits it ended
    return int(row["waiting"]) + int(row["delivered"])


def _purge(tx: Tx, age_s: float, limit: int) -> int:
    return tx.count("purge_events", {"age_s": age_s, "limit": limit})
