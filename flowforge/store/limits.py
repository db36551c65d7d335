"""The admission gate of concurrency limits (docs/flow-control.md "Concurrency and rate limits").

A task with a concurrency key never becomes READY by itself (insert_tasks, the release
fragment, promote_ready and retry_task_now leave it PENDING or RETRYING); the scheduler's
admission pass here makes it READY, with its outbox row, when its key has a free slot — and a
trigger creates it READY when its key has room (:func:`admit_new`). Tasks without a key never
come here: their path is unchanged.

The gate is one place to extend: another reason to hold a task back (a circuit breaker, a paused
queue or handler) is another condition of ``admit_concurrency``'s ``waiting`` CTE — or a pass
of its own on the same columns — and another branch of queries.sql's ``waiting_on`` fragment.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowforge.domain import transitions
from flowforge.domain.dag import MAX_CONCURRENCY
from flowforge.domain.plan import PlannedTask
from flowforge.domain.states import TaskState
from flowforge.store.part import Part, Tx

#: The advisory-lock namespace of concurrency keys ("CK"); ordering keys use "OR".
CONCURRENCY_LOCK_NAMESPACE = 0x434B


class Limits(Part):
    """The scheduler's admission pass."""

    def admit_concurrency(self, limit: int) -> int:
        """Up to ``limit`` keys with waiting tasks: each key's free slots admitted (PENDING with
        dependencies met, or due RETRYING → READY + outbox row), oldest first. Returns how many
        tasks were admitted. Never over a key's limit with any number of schedulers: each key
        is locked (advisory, transaction-scoped) before its holders are counted."""
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.READY)
        return self._transaction(_admit, limit)


def admit_new(tx: Tx, tasks: Sequence[PlannedTask]) -> list[bool]:
    """Which of ``tasks`` (about to be inserted by a trigger) are admitted at once: a task with a
    concurrency key that would be READY at creation (no dependency, no start gate, no ordering
    key) while its key has room, oldest first — room being the limit less the key's READY and
    RUNNING tasks and less those already waiting for admission (they go first). The keys are
    locked (as the admission pass locks them) until the trigger commits, so the count holds.
    Admitting here rather than leaving them PENDING for the scheduler saves a hop and an update
    per task. A task without a key is not judged (False)."""
    keys = sorted({t.concurrency_key for t in tasks if t.concurrency_key is not None})
    if not keys:
        return [False] * len(tasks)
    tx.all("lock_concurrency_keys", {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": keys})
    room = {
        r["key"]: (r["held"], r["waiting"], r["waiting_limit"])
        for r in tx.all("concurrency_room", {"keys": keys})
    }
    taken: dict[str, int] = {}
    admitted = []
    for task in tasks:
        key = task.concurrency_key
        if key is None or task.pending or task.ordering_key is not None:
            admitted.append(False)
            continue
        held, waiting, waiting_limit = room.get(key, (0, 0, None))
        limit = min(task.concurrency_limit or 1, waiting_limit or MAX_CONCURRENCY)
        free = limit - held - waiting - taken.get(key, 0)
        admitted.append(free > 0)
        if free > 0:
            taken[key] = taken.get(key, 0) + 1
    return admitted


def _admit(tx: Tx, limit: int) -> int:
    keys = [row["key"] for row in tx.all("concurrency_keys_waiting", {"limit": limit})]
    if not keys:
        return 0
    tx.all("lock_concurrency_keys", {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": keys})
    row = tx.one("admit_concurrency", {"keys": keys})
    admitted, queued = (int(row["admitted"]), int(row["queued"])) if row else (0, 0)
    if queued:
        tx.all("notify_outbox")
    return admitted
