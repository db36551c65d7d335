"""scripts/bench --soak and --payloads keep working: a short soak samples every figure and
judges them, a quick payload run measures every size (the figures are not judged here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.bench_payloads import SIZES
from tests.harness.bench_soak import HOT_TABLES
from tests.helpers import HARNESS_TIMEOUT_S, run_bench_json

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(HARNESS_TIMEOUT_S + 60),
]

VERDICTS = {"rss", "dispatch_p99", "hop_p99", "bloat", "connections"}


def test_a_short_soak_samples_every_figure_and_judges_them(
    tmp_path: Path, pg_server_url: str, broker_url: str
) -> None:
    out = tmp_path / "bench.json"
    out.write_text('{"results": {"kept": 1}}')  # merged into, not replaced
    report, stdout = run_bench_json(out, pg_server_url, broker_url, "--soak", "0.25")
    assert report["results"] == {"kept": 1}
    soak = report["soak"]
    settings = soak["settings"]
    assert settings["measured_max_chains_per_s"] > 0
    assert settings["rate_chains_per_s"] == pytest.approx(
        settings["measured_max_chains_per_s"] / 2, abs=0.01
    )
    samples = soak["samples"]
    assert len(samples) >= 10  # one every 1.25 s over 15 s, and the first
    assert sum(s["finished"] for s in samples) > 0
    for s in samples:
        assert any("worker" in label for label in s["rss_kb"]) and all(s["rss_kb"].values())
        assert set(s["tables"]) == set(HOT_TABLES)
        assert s["connections"] > 0
    assert any(s["hop_p99_ms"] is not None for s in samples)
    verdicts = soak["verdicts"]
    assert set(verdicts) == VERDICTS | {"steady_from_s"}
    assert verdicts["steady_from_s"] == 2.5  # a sixth of a short soak
    for name in ("rss", "connections"):  # judged: enough samples after the steady start
        assert verdicts[name]["ok"] in (True, False), verdicts[name]
    autovacuum = soak["autovacuum"]["autovacuum"]
    assert autovacuum in ("on", "off")
    assert (verdicts["bloat"]["ok"] is None) == (autovacuum == "off")
    assert set(verdicts["bloat"]["tables"]) == set(HOT_TABLES)
    assert "verdict rss" in stdout and "autovacuum:" in stdout  # the table


def test_a_quick_payload_run_measures_every_size(
    tmp_path: Path, pg_server_url: str, broker_url: str
) -> None:
    report, stdout = run_bench_json(
        tmp_path / "bench.json", pg_server_url, broker_url, "--payloads", "--quick"
    )
    results = report["payloads"]["results"]
    for size in SIZES:
        assert results[f"{size} B: tasks/s"]["median"] > 0
        # the blob is random: stored about its size (TOAST compression cannot shrink it)
        assert results[f"{size} B: stored input"]["median"] >= 0.7 * size
        assert results[f"{size} B: stored result"]["median"] >= 0.7 * size
        assert results[f"{size} B: workflow_runs per task"]["median"] > 0
    assert "100000 B: WAL per task" in stdout
