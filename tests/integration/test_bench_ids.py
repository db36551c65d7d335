"""``python -m tests.harness.bench_ids`` keeps working: a small store gives every figure for
both kinds of id, and each round made ids of its kind (the figures are not judged: the bench
measures, docs/performance.md says what they were)."""

from __future__ import annotations

import uuid

import pytest

from flowforge.domain import ids
from tests.harness import bench_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_small_run_reports_every_figure_for_both_kinds(pg_server_url: str) -> None:
    report = bench_ids.measure(pg_server_url, 500, 600, 2, lambda _m: None)
    assert report["rows"] == 500 and report["runs per round"] == 600
    for kind in bench_ids.KINDS:
        samples = report["samples"][kind]
        assert set(samples) == {
            "runs/s",
            "wal bytes per run",
            "fpi per run",
            "blocks read per run",
        }
        assert len(samples["runs/s"]) == 2 and min(samples["runs/s"]) > 0
        assert min(samples["wal bytes per run"]) > 0  # every run wrote rows


def test_the_kinds_swap_the_ids_planned_and_put_them_back() -> None:
    with bench_ids.ids_of("random"):
        assert ids.new_id().version == 4
    with bench_ids.ids_of("time-ordered"):
        assert ids.new_id().version == 7
    assert ids.new_id().version == 7 and isinstance(ids.new_id(), uuid.UUID)
