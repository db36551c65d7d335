"""The admission gate of concurrency and rate limits (docs/flow-control.md "Concurrency and rate
limits", "Rate limits").

A task with a concurrency or rate key never becomes READY by itself (``ready_by_itself`` is
false: insert_tasks, the release fragment, promote_ready and retry_task_now leave it PENDING or
RETRYING); the scheduler's admission pass here makes it READY, with its outbox row, when each
of its keys has room — and a trigger creates it READY when they have room now
(:func:`admit_new`). Tasks without a key never come here: their path is unchanged.

The gate is one place to extend: another reason to hold a task back (a circuit breaker, a paused
queue or handler) is another column of ``ready_by_itself`` (migration 0017), another condition
of ``admit_gated``'s ``waiting`` CTE — or a pass of its own on the same columns — and another
branch of queries.sql's ``waiting_on`` fragment.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowforge.domain import gates, transitions
from flowforge.domain.plan import PlannedTask
from flowforge.domain.states import TaskState
from flowforge.store.part import Part, Tx

#: The advisory-lock namespace of concurrency keys ("CK"); ordering keys use "OR".
CONCURRENCY_LOCK_NAMESPACE = 0x434B
#: ... and of rate keys ("RL"). Every transaction locks ordering keys, then concurrency keys,
#: then rate keys, each in key order: no two of them deadlock.
RATE_LOCK_NAMESPACE = 0x524C
#: ... and of maps whose max_parallel the admission applies ("MP"), after every key.
MAP_LOCK_NAMESPACE = 0x4D50


class Limits(Part):
    """The scheduler's admission pass."""

    def admit_gated(self, limit: int) -> int:
        """Up to ``limit`` concurrency keys and ``limit`` rate keys with waiting tasks: their
        tasks admitted (PENDING with dependencies met, or due RETRYING → READY + outbox row),
        oldest first, as many as each key has room for and at most ``limit`` per key (the
        oldest ``limit`` waiting tasks of a key are the pass's candidates: a map's 10,000 items
        waiting on one key are not all locked by every pass) — and, for a map's items, as many
        as the map's ``max_parallel`` has room for (its items READY or RUNNING: an item waiting
        for its key holds no slot). Returns how many tasks were admitted. Never over a key's
        limit nor a map's max_parallel with any number of schedulers and triggers: each key and
        each such map is locked (advisory, transaction-scoped) before its room is counted."""
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.READY)
        return self._transaction(_admit, limit)


def admit_new(tx: Tx, tasks: Sequence[PlannedTask]) -> list[bool]:
    """Which of ``tasks`` (about to be inserted by a trigger) are admitted at once
    (:func:`flowforge.domain.gates.admit_new`), their keys' rooms read under the keys' locks,
    which are held until the trigger commits, so the rooms hold. Admitting here rather than
    leaving them PENDING for the scheduler saves a hop and an update per task."""
    ckeys = sorted({t.concurrency_key for t in tasks if t.concurrency_key is not None})
    pers: dict[str, float] = {}
    for t in tasks:
        if t.rate_key is not None:
            pers[t.rate_key] = max(pers.get(t.rate_key, 0.0), t.rate_per_s or 0.0)
    if not ckeys and not pers:
        return [False] * len(tasks)
    concurrency: dict[str, gates.Room] = {}
    if ckeys:
        tx.all("lock_concurrency_keys", {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": ckeys})
        concurrency = {
            r["key"]: gates.Room(int(r["held"]), int(r["waiting"]), r["waiting_limit"])
            for r in tx.all("concurrency_room", {"keys": ckeys})
        }
    rate: dict[str, gates.Room] = {}
    if pers:
        rkeys = sorted(pers)
        tx.all("lock_concurrency_keys", {"namespace": RATE_LOCK_NAMESPACE, "keys": rkeys})
        rate = {
            r["key"]: gates.Room(
                int(r["ready"]) + int(r["started"]), int(r["waiting"]), r["waiting_limit"]
            )
            for r in tx.all("rate_room", {"keys": rkeys, "pers": [pers[k] for k in rkeys]})
        }
    return gates.admit_new(tasks, concurrency, rate)


def _admit(tx: Tx, limit: int) -> int:
    ckeys = [row["key"] for row in tx.all("concurrency_keys_waiting", {"limit": limit})]
    rkeys = [row["key"] for row in tx.all("rate_keys_waiting", {"limit": limit})]
    if not ckeys and not rkeys:
        return 0
    if ckeys:
        tx.all("lock_concurrency_keys", {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": ckeys})
    if rkeys:
        tx.all("lock_concurrency_keys", {"namespace": RATE_LOCK_NAMESPACE, "keys": rkeys})
    maps = tx.all("lock_admission_maps", {"namespace": MAP_LOCK_NAMESPACE, "limit": limit})
    params = {"ckeys": ckeys, "rkeys": rkeys, "per_key": limit, "maps": [m["id"] for m in maps]}
    row = tx.one("admit_gated", params)
    admitted, queued = (int(row["admitted"]), int(row["queued"])) if row else (0, 0)
    if queued:
        tx.all("notify_outbox")
    return admitted
