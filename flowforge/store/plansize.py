"""Generic plans kept only while the tables are about the size they were made at.

A statement prepared server-side (store/part.py ``PREPARED``) runs PostgreSQL's generic plan
once five custom ones have shown it is no worse (``plan_cache_mode = auto``, the server's
default): no planning at all per execution, which was 40 % of the hot path's server CPU
(docs/performance.md, "Generic plans at the tables' size"). The danger is when the plan was
made: PostgreSQL keeps a generic plan until something invalidates it (an ANALYZE, a VACUUM, a
change of the table), and a plan made while a table was small is a sequential scan or a hash
join over the whole table, which on a table grown since (a fresh install's first burst, a
10,000-task fan-out) is run for every row until autovacuum's next ANALYZE.

:class:`PlanSizes` closes that window. At most once per :data:`CHECK_S` a process reads the
physical size of the tables the prepared statements read (:data:`TABLES`, one cheap query:
``pg_relation_size`` asks the file system, not the statistics), as a *class* — the base-8
logarithm of each table's pages. When a reading finds a table in a higher class than the lowest
it was in since the pool was last drained, the pool is drained (psycopg_pool's ``drain``: its
idle connections are closed and new ones opened, each checked-out one is closed when it comes
back), so every statement is prepared and planned again, in a new session, at the size the
tables have now. Tables below :data:`FLOOR_PAGES` are all in the lowest class: a plan that
reads one of them whole reads at most a quarter of a megabyte. Not ``DISCARD PLANS``, which
keeps each statement's history: PostgreSQL picks the generic plan only while its cost is no
more than the average of every custom plan the statement was given, and a connection that
worked while the tables were small keeps a small average for thousands of executions after they
grew — planning every one of them. Nor ``DEALLOCATE ALL``: psycopg keeps its own table of what
it prepared and only notices that command the first time a connection runs it, so a second one
left it executing statements the server no longer had (docs/performance.md, "Generic plans at
the tables' size").

Only growth drains. A plan made on bigger tables reads them through indexes, which stays right
(and cheap) on smaller ones, so a shrink (a retention purge, a VACUUM truncating the outbox, a
bench's TRUNCATE) only lowers the class a regrowth is measured from: a connection the pool
opened while the tables were small planned at that size, and the next growth past it drains.
Each drain costs every connection a new session, its catalog caches and five custom plans per
statement, so the classes are coarse: a table grows through about five of them from empty to
a million rows. So a generic plan is only ever run on tables at most about eight times larger
than it was made for, or below the floor (or for the :data:`CHECK_S` after a jump), where its
choices are the custom plan's (tests/integration/test_prepared_plans.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flowforge.store import queries

#: The tables the prepared statements read or write (store/part.py ``PREPARED``; a unit test
#: checks every table their SQL names is here).
TABLES = (
    "workflow_runs",
    "task_runs",
    "task_edges",
    "task_attempts",
    "outbox",
    "idempotency_keys",
    "workflow_definitions",
    "counters",
    "breakers",
    "breaker_transitions",
    "schedules",
)
#: Below this many pages (8 KiB each) a table is in the lowest class: whatever its plans,
#: reading it whole costs less than the new sessions a drain makes every process open
#: (docs/performance.md, "Fewer drains").
FLOOR_PAGES = 32
#: Seconds between two readings of the tables' sizes by one process.
CHECK_S = 1.0
#: The named query (queries.sql) this module runs itself.
NAMES = ("plan_table_pages",)

SizeClass = tuple[int, ...]


class Connection(Protocol):
    """What :meth:`PlanSizes.changed` needs of a connection (psycopg's)."""

    def execute(self, query: Any, params: Any = None) -> Any:
        """Run ``query`` with ``params``; a cursor over its rows."""


def size_class(pages: Sequence[int]) -> SizeClass:
    """Each table's pages in classes of a factor of 8 from :data:`FLOOR_PAGES` (0 below it,
    then 1 from 32 pages, 2 from 256, 3 from 2,048, ...): a class changes when a table past
    the floor grows or shrinks about eightfold."""
    return tuple(
        0 if p < FLOOR_PAGES else (int(p).bit_length() - FLOOR_PAGES.bit_length()) // 3 + 1
        for p in pages
    )


class PlanSizes:
    """Per process: the tables' size class, read at most once per ``check_s`` (seconds), and
    the lowest class of each since the pool was last drained (module docstring).

    Shared by a pool's threads without a lock: two threads that find the reading stale at once
    both read it (one query more, the same answer; a change may then drain the pool twice,
    which costs a few reconnections). ``clock`` (monotonic seconds) is a seam for tests."""

    def __init__(
        self, check_s: float = CHECK_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._check_s = check_s
        self._clock = clock
        self._lowest: SizeClass | None = None
        self._read_at = 0.0
        self._pages = queries.load()[NAMES[0]]

    def changed(self, conn: Connection) -> bool:
        """Before a checked-out connection's first statement (idle, autocommit): read the
        sizes on it if the last reading is ``check_s`` old. True if that reading found a table
        in a higher class than the lowest it was in since the last True: the caller drains its
        pool. A lower class is remembered, never reported. The first reading of a process
        changes nothing (its connections are as new as it is)."""
        now = self._clock()
        if self._lowest is not None and now - self._read_at < self._check_s:
            return False
        rows = conn.execute(self._pages, {"tables": list(TABLES)}).fetchall()
        current = size_class([_pages(row) for row in rows])
        self._read_at = now
        lowest = current if self._lowest is None else tuple(map(min, current, self._lowest))
        grew = current != lowest  # some table above the lowest class it was in
        self._lowest = current if grew else lowest  # a drain: the new sessions plan at size
        return grew


def _pages(row: Any) -> int:
    return int(row["pages"] if isinstance(row, dict) else row[0])
