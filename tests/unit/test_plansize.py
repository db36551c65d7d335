"""store/plansize.py: a change of the tables' size class is reported once (the Database then
drains its pool), and the sizes are read at most once per interval (a fake connection and
clock)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import flowforge.store
from flowforge.store import queries
from flowforge.store.part import PREPARED
from flowforge.store.plansize import TABLES, PlanSizes, size_class

MIGRATIONS = Path(flowforge.store.__file__).parent / "migrations"
CREATE_TABLE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)", re.IGNORECASE)
PAGES = queries.load()["plan_table_pages"]


class FakeConnection:
    """Answers the size query with the pages set on it; records every statement."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.sent: list[bytes] = []
        self._rows: list[dict[str, int]] = []

    def execute(self, query: bytes, params: Any = None) -> FakeConnection:
        self.sent.append(query)
        if query == PAGES:
            self._rows = [{"pages": self.sizes.get(t, 0)} for t in params["tables"]]
        return self

    def fetchall(self) -> list[dict[str, int]]:
        return self._rows


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_size_classes_change_about_eightfold_above_the_floor() -> None:
    pages = [0, 1, 31, 32, 255, 256, 2047, 2048, 16383, 16384]
    assert size_class(pages) == (0, 0, 0, 1, 1, 2, 2, 3, 3, 4)


def test_the_first_reading_changes_nothing() -> None:
    conn = FakeConnection({"task_runs": 10})
    assert not PlanSizes(clock=Clock()).changed(conn)
    assert conn.sent == [PAGES]


def test_the_sizes_are_read_once_per_interval_by_the_process() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    first, second = FakeConnection({}), FakeConnection({})
    plans.changed(first)
    plans.changed(second)
    clock.now += 0.5
    plans.changed(first)
    assert first.sent == [PAGES] and second.sent == []
    clock.now += 0.5
    plans.changed(second)
    assert second.sent == [PAGES]


def test_a_table_grown_eightfold_is_a_change_once() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    sizes = {"task_runs": 32}
    conn = FakeConnection(sizes)
    assert not plans.changed(conn)
    sizes["task_runs"] = 255  # the same class: the plans suit
    clock.now += 1.0
    assert not plans.changed(conn)
    sizes["task_runs"] = 256
    clock.now += 1.0
    assert plans.changed(conn)
    clock.now += 1.0
    assert not plans.changed(conn)  # read again at the same class: nothing new


def test_a_shrink_is_no_change_but_a_regrowth_from_it_is() -> None:
    """A plan made on bigger tables stays right on smaller ones; a connection opened while
    they were small planned at that size, so growing back from there drains."""
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    sizes = {"outbox": 500, "task_runs": 3000}
    conn = FakeConnection(sizes)
    assert not plans.changed(conn)
    sizes["outbox"] = 3  # retention purged it and VACUUM truncated the file
    clock.now += 1.0
    assert not plans.changed(conn)
    sizes["outbox"] = 40  # above the lowest class since the drain, below the first reading
    clock.now += 1.0
    assert plans.changed(conn)
    sizes["outbox"] = 3
    clock.now += 1.0
    assert not plans.changed(conn)  # measured from the drain's class now: a shrink again
    sizes["outbox"] = 31  # within the lowest class: nothing to plan again
    clock.now += 1.0
    assert not plans.changed(conn)
    sizes["outbox"] = 32
    clock.now += 1.0
    assert plans.changed(conn)


def test_only_the_table_that_grew_counts() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    sizes = {"outbox": 500, "task_runs": 30}
    conn = FakeConnection(sizes)
    assert not plans.changed(conn)
    sizes.update(outbox=3, task_runs=40)  # one shrank, one grew a class
    clock.now += 1.0
    assert plans.changed(conn)


def test_every_table_the_prepared_statements_name_is_watched() -> None:
    created = {
        m.group(1)
        for path in MIGRATIONS.glob("*.sql")
        for m in CREATE_TABLE.finditer(path.read_text(encoding="utf-8"))
    }
    named = {
        word
        for name in PREPARED
        for word in re.findall(r"[a-z_]+", queries.load()[name].decode())
        if word in created
    }
    assert {"task_runs", "outbox"} <= named
    assert named - set(TABLES) == set()
