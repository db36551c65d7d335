"""The scheduler's passes over map tasks (``for_each``, SPEC 7.3; docs/dynamic.md "Map").

A map task's row never reaches a worker. Three passes move it:

- :meth:`Maps.expand_maps`: a map whose dependencies are met is judged
  (:func:`~flowforge.domain.maps.plan_items`) and then either expanded — RUNNING plus one item
  row per element of its upstream's list, in one statement — or buried DEAD with a reason.
  The map row stays locked from the read to the commit, so however many schedulers race or die,
  a map is expanded once: a killed expansion commits nothing and is done again by the next pass.
- :meth:`Maps.open_item_slots`: items past ``max_parallel`` wait for a slot; freed slots are
  handed to the lowest-index waiting items.
- :meth:`Maps.settle_maps`: a RUNNING map none of whose items is unfinished takes its state
  from them (results in item order on success) and releases its dependents.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.maps import MapFailure, plan_items
from flowforge.domain.states import TaskState
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

    def map_item_counts(self, map_ids: Sequence[UUID]) -> dict[UUID, dict[str, int]]:
        """Each map's items counted by state (maps without items are absent)."""
        counts: dict[UUID, dict[str, int]] = {}
        for row in self._query("map_item_counts", {"ids": list(map_ids)}):
            counts.setdefault(row["map_id"], {})[row["state"]] = int(row["n"])
        return counts

    def map_items_page(self, map_id: UUID, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` items of a map in item order, after item index ``after`` (-1: from
        the first)."""
        return self._query("map_items_page", {"id": map_id, "after": after, "limit": limit})


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
