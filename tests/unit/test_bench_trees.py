"""``scripts/bench --trees`` without trees: how it credits attempts to trees and merges its
report (tests/harness/bench_trees.py; its CPU readings: tests/unit/test_cpuprobe.py). The
workload itself runs real trees and is never run by the suite (docs/performance.md, "Several
trees")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.harness import bench, bench_trees


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
