"""The read model of a run's timeline (the run page's Gantt, docs/dashboard-contract.md
"Timeline"): its tasks with their attempts, as the store reads them — bounded.

A run can be large (a map of 10,000 items, a task retried hundreds of times across requeues),
so the store never reads it whole: :class:`TimelineLimits` says how much, and what it leaves
out is counted, never dropped silently — the tasks beyond ``tasks`` (:attr:`TimelineFacts.
tasks_total`), a map's items beyond the first ``items`` (one :class:`MapRest` per map: their
counts and envelope) and a row's attempts before its latest ``attempts`` (their numbers start
above 1). ``flowforge/dashboard/timeline.py`` lays the facts out as rows and segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal
from uuid import UUID

from flowforge.domain.model import Attempt, Run

#: What runs a task: a worker (attempts), or a scheduler pass (one span from its start).
TaskKind = Literal["worker", "timer", "map", "event", "child"]


@dataclass(frozen=True)
class TimelineLimits:
    """How much of a run a timeline reads.

    ``tasks``: top-level tasks, in creation order; ``items``: items of each map, in item order;
    ``item_rows``: items of all maps together (the first maps' first); ``attempts``: the latest
    attempts of each task or item. Every bound is at least 1.
    """

    tasks: int = 500
    items: int = 20
    item_rows: int = 200
    attempts: int = 10

    def __post_init__(self) -> None:
        for name in ("tasks", "items", "item_rows", "attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"timeline limit {name} must be at least 1")


@dataclass(frozen=True)
class TimelineTask:
    """A task (or a map's item: ``map_id`` and ``item_index`` set) as the timeline draws it.

    ``eligible_at``: when it could first start — its dependencies all finished (the latest of
    their ``finished_at``), its run's start time reached; an item: its map's expansion. None
    while a dependency is unfinished. ``attempt``: how many attempts it has had;
    ``attempts``: the latest of them (at most the limit), first first, ``error`` cut.
    """

    id: UUID
    name: str
    handler: str
    kind: TaskKind
    state: str
    attempt: int
    created_at: datetime
    eligible_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    retry_at: datetime | None
    failure_reason: str | None
    map_id: UUID | None
    item_index: int | None
    attempts: tuple[Attempt, ...] = ()


@dataclass(frozen=True)
class MapRest:
    """A map's items beyond those shown: how many (``n``), by state, their attempts in all,
    the first one's start and the last one's finish (None when none has), and how many have
    started and not finished."""

    map_id: UUID
    n: int
    counts: dict[str, int]
    attempts: int
    first_started_at: datetime | None
    last_finished_at: datetime | None
    unfinished_started: int


@dataclass(frozen=True)
class TimelineFacts:
    """Everything a timeline shows, read in one transaction at ``now`` (the database clock).

    ``tasks``: top-level tasks in creation order, each map followed by its shown items in item
    order; ``tasks_total``: the run's top-level tasks, shown or not; ``rests``: per map with
    items left out.
    """

    run: Run
    now: datetime
    tasks: tuple[TimelineTask, ...]
    tasks_total: int
    rests: tuple[MapRest, ...]
    limits: TimelineLimits


def shown_items(tasks: tuple[TimelineTask, ...]) -> dict[UUID, int]:
    """How many items of each map ``tasks`` shows (every map, 0 for one with none shown): the
    store reads the rest of each map from that index on (items are numbered from 0 and read in
    order, so the shown ones are the first)."""
    shown = {t.id: 0 for t in tasks if t.kind == "map"}
    for task in tasks:
        if task.map_id is not None and task.map_id in shown:
            shown[task.map_id] += 1
    return shown
