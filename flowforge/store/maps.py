"""The scheduler's passes over map tasks (``for_each``, SPEC 7.3; docs/dynamic.md "Map").

A map task's row never reaches a worker. Three passes move it:

- :meth:`Maps.expand_maps`: a map whose dependencies are met is judged
  (:func:`~flowforge.domain.maps.plan_items`) and then either expanded — RUNNING plus one item
  row per element of its upstream's list, in one statement — or buried DEAD with a reason.
  An item of a map with ``concurrency`` or ``rate_limit`` is created with its rendered keys and
  the limits, so it is not ``ready_by_itself``: the admission pass (store/limits.py) makes it
  READY, as any limited task.
  The map row stays locked from the read to the commit, so however many schedulers race or die,
  a map is expanded once: a killed expansion commits nothing and is done again by the next pass.
- :meth:`Maps.open_item_slots`: items past ``max_parallel`` wait for a slot; freed slots are
  handed to the lowest-index waiting items.
- :meth:`Maps.settle_maps`: a RUNNING map none of whose items is unfinished takes its state
  from them (results in item order on success) and releases its dependents.

And one read: :meth:`Maps.map_page`, a map's items counted by state, then a page of them.
"""

from __future__ import annotations

import logging
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.maps import (
    MapFailure,
    cursor_index,
    item_cursor,
    item_state,
    page_limit,
    plan_items,
)
from flowforge.domain.model import MapPage, parse_id
from flowforge.domain.states import TaskState
from flowforge.errors import NotFoundError
from flowforge.store import rows
from flowforge.store.part import Part, Tx

logger = logging.getLogger(__name__)

#: Maps expanded per pass at most, whatever the batch size: one map can be 10,000 rows.
MAPS_PER_PASS = 4


class Maps(Part):
    """Expanding, feeding and settling map tasks; reading their items compactly."""

    def expand_maps(self, limit: int) -> int:
        """Maps whose dependencies are met: PENDING → RUNNING with their items inserted, or
        PENDING → DEAD (``not_a_list``, ``too_many_items``, ``item_key_error``). Returns how
        many maps this pass expanded or buried (at most ``limit`` and MAPS_PER_PASS)."""
        transitions.check(TaskState.PENDING, TaskState.RUNNING)
        transitions.check(TaskState.PENDING, TaskState.DEAD)
        buried: list[tuple[UUID, MapFailure]] = []
        done = self._transaction(_expand, min(limit, MAPS_PER_PASS), buried)
        for task_id, failure in buried:  # after the commit: a retried transaction logs once
            logger.warning(
                "map task %s is DEAD (%s): %s",
                task_id,
                failure.reason,
                failure.error,
                extra={"action": "map_buried", "task_run_id": str(task_id)},
            )
        return done

    def open_item_slots(self, limit: int) -> int:
        """Hands free ``max_parallel`` slots of up to ``limit`` RUNNING maps to their
        lowest-index waiting items (promote_ready then dispatches them). Returns how many."""
        found = self._query("open_item_slots", {"limit": limit})
        return int(found[0]["n"]) if found else 0

    def settle_maps(self, limit: int) -> int:
        """RUNNING maps with every item finished: → SUCCEEDED (results in item order,
        dependents released), DEAD (``item_failed``) or CANCELLED. Returns how many."""
        transitions.check(TaskState.RUNNING, TaskState.SUCCEEDED)
        return self._transaction(_settle, limit)

    def map_page(
        self,
        task_run_id: UUID | str,
        cursor: str | None = None,
        limit: int = 100,
        state: TaskState | str | None = None,
    ) -> MapPage:
        """A map task with all its items counted by state and up to ``limit`` (1 to
        MAX_ITEMS_PAGE) of its items in item order — those in ``state`` only, if given — after
        the item ``cursor`` names (None: from the first). :class:`InputError` for a malformed
        cursor, limit or state; :class:`NotFoundError` if the id names no task run, or one that
        is not a map."""
        tid = parse_id(task_run_id, "task run id")
        after = -1 if cursor is None else cursor_index(cursor)
        wanted = item_state(state)
        return self._transaction(_map_page, tid, after, page_limit(limit), wanted)


def _expand(tx: Tx, limit: int, buried: list[tuple[UUID, MapFailure]]) -> int:
    buried.clear()  # a retried transaction starts over
    due = tx.all("lock_maps_to_expand", {"limit": limit})
    done = 0
    for row in due:
        planned = plan_items(
            row["source"],
            row["input"] or {},
            row["definition"] or {},
            row["max_items"],
            source_name=repr(row["for_each"]),
        )
        if isinstance(planned, MapFailure):
            params = {"id": row["id"], "reason": str(planned.reason), "error": planned.error}
            if tx.all("bury_map", params):
                buried.append((row["id"], planned))
                done += 1
            continue
        expanded = tx.one(
            "expand_map",
            {
                "id": row["id"],
                "idem_keys": planned.idempotency_keys,
                "ordering_keys": planned.ordering_keys,
                "concurrency_keys": planned.concurrency_keys,
                "concurrency_limit": planned.concurrency_limit,
                "rate_keys": planned.rate_keys,
                "rate_limit": planned.rate_limit,
                "rate_per_s": planned.rate_per_s,
                "breaker_keys": planned.breaker_keys,
            },
        )
        done += int(expanded["expanded"]) if expanded else 0
    return done  # (work done: the scheduler's loop runs its next pass at once)


def _settle(tx: Tx, limit: int) -> int:
    row = tx.one("settle_maps", {"limit": limit})
    settled, queued = (int(row["settled"]), int(row["queued"])) if row else (0, 0)
    if queued:
        tx.all("notify_outbox")
    return settled


def _map_page(tx: Tx, tid: UUID, after: int, limit: int, state: TaskState | None) -> MapPage:
    row = tx.one("get_task", {"id": tid})
    if row is None:
        raise NotFoundError(f"no task run with id {tid}")
    if row["for_each"] is None:
        raise NotFoundError(f"task run {tid} is not a map (for_each) task: it has no items")
    counts = {r["state"]: int(r["n"]) for r in tx.all("map_item_counts", {"ids": [tid]})}
    params = {"id": tid, "after": after, "limit": limit + 1, "state": state and str(state)}
    page = tx.all("map_items_page", params)
    items = tuple(rows.map_item(r) for r in page[:limit])
    more = len(page) > limit and bool(items)
    return MapPage(
        rows.task_run(row), counts, items, item_cursor(items[-1].index) if more else None
    )
