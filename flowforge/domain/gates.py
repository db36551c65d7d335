"""Which of a trigger's new tasks its keys admit at once (concurrency and rate limits, SPEC 7.4;
docs/flow-control.md "Concurrency and rate limits", "Rate limits"). Pure: the store reads each
key's room under the key's lock and asks this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flowforge.domain.plan import PlannedTask


@dataclass(frozen=True)
class Room:
    """A key's room as a trigger's transaction reads it under the key's lock: ``used`` (for a
    concurrency key its READY and RUNNING tasks; for a rate key its READY tasks and its
    attempts started within the window), ``waiting`` (tasks the admission pass would admit:
    they go first) and ``waiting_limit`` (the smallest limit among its waiting tasks; None:
    none waits)."""

    used: int
    waiting: int
    waiting_limit: int | None


def admit_new(
    tasks: Sequence[PlannedTask],
    concurrency: Mapping[str, Room],
    rate: Mapping[str, Room],
) -> list[bool]:
    """For each task, oldest first, whether it is created READY: it has a key of either kind
    (a task with neither is not judged: False), would be READY at creation (no dependency, no
    start gate, no ordering key), and each of its keys has room — its limit (the smaller of its
    own and the waiting tasks') less what the key uses, less its waiting tasks, less what this
    trigger already admitted to it. A task held by one key takes no room of the other."""
    taken_c: dict[str, int] = {}
    taken_r: dict[str, int] = {}
    admitted = []
    for task in tasks:
        ckey, rkey = task.concurrency_key, task.rate_key
        if (ckey is None and rkey is None) or task.pending or task.ordering_key is not None:
            admitted.append(False)
            continue
        ok = True
        if ckey is not None:
            ok = _free(concurrency.get(ckey), task.concurrency_limit, taken_c.get(ckey, 0))
        if ok and rkey is not None:
            ok = _free(rate.get(rkey), task.rate_limit, taken_r.get(rkey, 0))
        admitted.append(ok)
        if ok:
            if ckey is not None:
                taken_c[ckey] = taken_c.get(ckey, 0) + 1
            if rkey is not None:
                taken_r[rkey] = taken_r.get(rkey, 0) + 1
    return admitted


def _free(room: Room | None, own_limit: int | None, taken: int) -> bool:
    room = room or Room(0, 0, None)
    limit = min(own_limit or 1, room.waiting_limit or own_limit or 1)
    return limit - room.used - room.waiting - taken > 0
