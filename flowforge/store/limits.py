"""The admission gate of concurrency limits (docs/flow-control.md "Concurrency and rate limits").

A task with a concurrency key never becomes READY by itself (insert_tasks, the release
fragment, promote_ready and retry_task_now leave it PENDING or RETRYING); the scheduler's
admission pass here makes it READY, with its outbox row, when its key has a free slot. Tasks
without a key never come here: their path is unchanged.

The gate is one place to extend: another reason to hold a task back (a circuit breaker, a paused
queue or handler) is another condition of ``admit_concurrency``'s ``waiting`` CTE — or a pass
of its own on the same columns — and another value of :func:`~flowforge.domain.waiting.waiting_on`.
"""

from __future__ import annotations

from flowforge.domain import transitions
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
