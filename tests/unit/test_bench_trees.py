"""``scripts/bench --trees`` without trees: how it reads CPU from /proc, credits attempts to
trees and merges its report (tests/harness/bench_trees.py). The workload itself runs real trees
and is never run by the suite (docs/performance.md, "Several trees")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.harness import bench, bench_trees


def test_cpu_is_read_per_process_and_a_gone_process_is_left_out() -> None:
    me = os.getpid()
    readings = bench_trees.cpu_seconds([me, 2**22 + 1])  # above pid_max's default: no such pid
    assert list(readings) == [me]
    assert readings[me] > 0  # this interpreter has run


def test_cpu_spent_counts_new_processes_whole_and_ignores_ended_ones() -> None:
    before = {1: 2.0, 2: 5.0, 3: 1.0}  # 3 ends before the second reading
    after = {1: 2.5, 2: 7.0, 4: 0.25}  # 4 started between them
    assert bench_trees.spent(before, after) == 0.5 + 2.0 + 0.25


class Attempts:
    def __init__(self, rows: list[tuple[str, int]]) -> None:
        self.rows = rows

    def execute(self, query: str) -> Attempts:
        assert "task_attempts" in query
        return self

    def fetchall(self) -> list[tuple[str, int]]:
        return self.rows


def test_attempts_are_credited_to_the_tree_whose_process_made_them() -> None:
    conn: Any = Attempts([("host/10", 7), ("host/11", 3), ("other/20", 5), ("host/99", 1)])
    assert bench_trees._attempts_by_tree(conn, [[1, 10, 11], [2, 20]]) == [10, 5]


def test_the_trees_report_is_merged_into_the_json_beside_other_figures(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": {"throughput": {}}}))
    bench.merge_json(path, "trees", {"results": {"trees 1: tasks/s": {}}})
    assert json.loads(path.read_text()) == {
        "results": {"throughput": {}},
        "trees": {"results": {"trees 1: tasks/s": {}}},
    }
    path.write_text("not json")
    bench.merge_json(path, "trees", {"x": 1})
    assert json.loads(path.read_text()) == {"trees": {"x": 1}}
