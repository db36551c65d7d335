"""scripts/bench keeps working: a small run produces every figure (the figures are not judged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import HARNESS_TIMEOUT_S, run_bench_json

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(HARNESS_TIMEOUT_S + 60),
]

FIGURES = {
    "throughput",
    "trigger rate",
    "rate-limited starts",
    "rate-limited peak per 1s",
    "fan-out",
    "fan-out wall",
    "chain p50",
    "chain p99",
    "dispatch p50",
    "dispatch p99",
    "api trigger",
    "api trigger p50",
    "api read",
    "api live",
    "schedules due",
    "schedule runs",
    "schedule idle pass db",
    "schedule idle pass",
    "event round trip p50",
    "event round trip p99",
    "event send p50",
    "submit one",
    "submit threads",
    "submit http",
    "submit many",
    "submit http batch",
}


def test_a_quick_bench_run_reports_every_figure(
    tmp_path: Path, pg_server_url: str, broker_url: str
) -> None:
    report, stdout = run_bench_json(tmp_path / "bench.json", pg_server_url, broker_url, "--quick")
    assert set(report["results"]) >= FIGURES
    for name in FIGURES:
        figure = report["results"][name]
        assert figure["samples"] and figure["median"] > 0, name
    assert report["scale_ratio"] > 0
    load = report["memory"]["load"]
    assert load["rss_kb"] > 0
    roles = {name.removeprefix("flowforge: ") for name in load["by_process"]}
    assert {"scheduler", "publisher", "api"} <= roles and any("worker" in r for r in roles), roles
    assert (
        sum(kb for name, kb in load["by_process"].items() if name != "flowforge: api")
        == (load["rss_kb"])
    )
    assert {"cpu", "cores", "postgresql", "rabbitmq", "python"} <= set(report["machine"])
    floors = report["floors"]
    assert floors["postgresql_commits_per_s"] > 0 and floors["postgresql_round_trip_ms"] > 0
    assert floors["python_loop_ms"] > 0
    assert "throughput" in stdout and "machine floors" in stdout  # the table
