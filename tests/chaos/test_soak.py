"""The short variant of scripts/chaos: load plus injected faults, then every invariant holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the soak's 45 s, its faults' recoveries and its quiescence outlast pytest's 120 s default
# on a loaded machine; the harness bounds itself (subprocess timeout below)
pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(660)]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    report_path = tmp_path / "chaos.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.harness.chaos",
            "--duration",
            "45",
            "--seed",
            "20261129",
            "--intensity",
            "8",
            "--json",
            str(report_path),
        ],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert report_path.exists(), result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["quiesced"], result.stdout
    assert report["violations"] and all(n == 0 for n in report["violations"].values()), (
        result.stdout
    )
    assert report["violations_total"] == 0
    assert result.returncode == 0
    assert sum(report["faults"].values()) >= 3, report["faults"]  # faults really were injected
    assert report["runs_total"] > 50 and report["executions"] > 0
