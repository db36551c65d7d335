"""A run's timeline, read for the run page's Gantt (``GET /api/v1/runs/{id}/timeline``;
docs/dashboard-contract.md "Timeline").

One read-only transaction of four statements, each bounded by :class:`TimelineLimits`
whatever the run's size: the run and the database's clock, its tasks (maps followed by their
first items), their latest attempts, and a count of what each map's items left out.
"""

from __future__ import annotations

from collections import defaultdict
from uuid import UUID

from flowforge.domain.model import Attempt, parse_id
from flowforge.domain.timeline import TimelineFacts, TimelineLimits, shown_items
from flowforge.errors import NotFoundError
from flowforge.store import rows
from flowforge.store.part import Part, Tx

#: Characters of an attempt's error a timeline reads: its first line is all it shows.
ERROR_CHARS = 1000


class Timelines(Part):
    """The run page's timeline."""

    def timeline(self, run_id: UUID | str, limits: TimelineLimits) -> TimelineFacts:
        """The run's tasks and attempts within ``limits``, at the database's now;
        :class:`InvalidIdError` for a malformed id, :class:`NotFoundError` for no such run."""
        return self._transaction(_timeline, parse_id(run_id, "run id"), limits)


def _timeline(tx: Tx, rid: UUID, limits: TimelineLimits) -> TimelineFacts:
    run = tx.one("get_run", {"id": rid})
    if run is None:
        raise NotFoundError(f"no run with id {rid}")
    clock = tx.one("database_now")
    assert clock is not None  # SELECT now() has its row
    found = tx.all(
        "timeline_tasks",
        {
            "id": rid,
            "max_tasks": limits.tasks,
            "max_items": limits.items,
            "max_item_rows": limits.item_rows,
        },
    )
    ids = [r["id"] for r in found]
    by_task: defaultdict[UUID, list[Attempt]] = defaultdict(list)
    params = {"ids": ids, "max_attempts": limits.attempts, "error_chars": ERROR_CHARS}
    for row in tx.all("timeline_attempts", params):
        by_task[row["task_run_id"]].append(rows.attempt(row))
    tasks = tuple(rows.timeline_task(r, tuple(by_task[r["id"]])) for r in found)
    shown = shown_items(tasks)
    rests = tx.all("timeline_map_rests", {"maps": list(shown), "shown": list(shown.values())})
    return TimelineFacts(
        run=rows.run(run),
        now=clock["now"],
        tasks=tasks,
        tasks_total=int(found[0]["total"]) if found else 0,
        rests=tuple(rows.map_rest(r) for r in rests),
        limits=limits,
    )
