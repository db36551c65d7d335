"""``scripts/bench --stored`` keeps working: a small store produces every figure, empty and
loaded (the figures are not judged: the bench measures, docs/performance.md says what they were)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import bench_stored

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_a_small_stored_bench_reports_every_figure_empty_and_loaded(
    tmp_path: Path, pg_server_url: str, broker_url: str
) -> None:
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"results": {"kept": 1}}))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.harness.bench",
            "--stored",
            "2000",
            "--quick",
            "--workers",
            "1",
            "--json",
            str(out),
            "--database-url",
            pg_server_url,
            "--broker-url",
            broker_url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["results"] == {"kept": 1}  # merged, not overwritten
    stored = report["stored"]
    assert stored["rows"] == 2000
    assert stored["dead"] == 2000 // bench_stored.DEAD_SHARE
    names = set(bench_stored.ENGINE) | set(bench_stored.PAGES) | {"stats"}
    assert set(stored["figures"]) == names
    for name, figure in stored["figures"].items():
        assert figure["empty"] > 0 and figure["loaded"] > 0, name
    # 2,000 backlog tasks, 2,000 finished runs and the bench's own: each a few hundred bytes
    assert stored["size"]["task_runs"] >= 4000
    assert 100 < stored["size"]["bytes_per_task_run"] < 100_000
    assert "bytes per task run" in result.stdout
    purge = stored["retention"]
    assert purge["purge rate"] > 0  # the tree's retention found the filled runs due
    assert purge["tasks/s while purging"] > 0 and purge["longest lock wait"] >= 0
