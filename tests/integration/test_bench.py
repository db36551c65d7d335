"""scripts/bench keeps working: a small run produces every figure (the figures are not judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
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
    "submit http",
    "submit many",
    "submit http batch",
}


def test_a_quick_bench_run_reports_every_figure(
    tmp_path: Path, pg_server_url: str, broker_url: str
) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.harness.bench",
            "--quick",
            "--workers",
            "2",
            "--json",
            str(out),
            "--database-url",
            pg_server_url,
            "--broker-url",
            broker_url,
        ],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) >= FIGURES
    for name in FIGURES:
        figure = report["results"][name]
        assert figure["samples"] and figure["median"] > 0, name
    assert report["scale_ratio"] > 0
    assert report["memory"]["load"]["rss_kb"] > 0
    assert {"cpu", "cores", "postgresql", "rabbitmq", "python"} <= set(report["machine"])
    floors = report["floors"]
    assert floors["postgresql_commits_per_s"] > 0 and floors["postgresql_round_trip_ms"] > 0
    assert floors["python_loop_ms"] > 0
    assert "throughput" in result.stdout and "machine floors" in result.stdout  # the table
