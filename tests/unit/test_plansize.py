"""store/plansize.py: a connection whose plans were made at another size class of the tables
is refused (the Database closes it and takes another), and the sizes are read at most once per
interval (a fake connection and clock)."""

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


def test_size_classes_change_about_fourfold() -> None:
    assert size_class([0, 1, 2, 7, 8, 31, 32, 127, 128]) == (0, 0, 1, 1, 2, 2, 3, 3, 4)


def test_a_new_connection_reads_the_sizes_and_is_ready() -> None:
    conn = FakeConnection({"task_runs": 10})
    assert PlanSizes(clock=Clock()).ready(conn)
    assert conn.sent == [PAGES]


def test_the_sizes_are_read_once_per_interval_by_the_process() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    first, second = FakeConnection({}), FakeConnection({})
    plans.ready(first)
    plans.ready(second)
    clock.now += 0.5
    plans.ready(first)
    assert first.sent == [PAGES] and second.sent == []
    clock.now += 0.5
    plans.ready(second)
    assert second.sent == [PAGES]


def test_a_connection_made_before_a_table_grew_fourfold_is_refused() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    sizes = {"task_runs": 8}
    conn = FakeConnection(sizes)
    assert plans.ready(conn)
    sizes["task_runs"] = 31  # the same class: its plans suit
    clock.now += 1.0
    assert plans.ready(conn)
    sizes["task_runs"] = 32
    clock.now += 1.0
    assert not plans.ready(conn)
    assert plans.ready(FakeConnection(sizes))  # its replacement plans at this class


def test_every_connection_made_at_the_old_class_is_refused_and_a_shrink_counts_too() -> None:
    clock = Clock()
    plans = PlanSizes(check_s=1.0, clock=clock)
    sizes = {"outbox": 500}
    a, b = FakeConnection(sizes), FakeConnection(sizes)
    assert plans.ready(a) and plans.ready(b)
    sizes["outbox"] = 3  # retention purged it and VACUUM truncated the file
    clock.now += 1.0
    assert not plans.ready(a) and not plans.ready(b)


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
