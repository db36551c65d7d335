"""tests/harness/row_cost on real PostgreSQL: a short run measures every workload on every
layout it is given, and the shipped layouts apply to the current schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import row_cost

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYOUTS = Path(row_cost.__file__).parent / "row_cost_layouts"


def test_a_short_run_reports_each_workload_for_each_layout(
    pg_server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    layouts = ["shipped=", *(f"{p.stem}={p}" for p in sorted(LAYOUTS.glob("*.sql")))]
    argv = ["--database-url", pg_server_url, "--rounds", "1", "--n", "40"]
    argv += ["--fanout", "1000", "--map-items", "5000"]  # the shape, not the size
    assert row_cost.main([*argv, *(a for layout in layouts for a in ("--layout", layout))]) == 0
    out = capsys.readouterr().out
    medians = dict(
        ((m["work"], m["layout"]), float(m["us"]))
        for m in re.finditer(r"^(?P<work>\w+) +(?P<layout>\w+) +(?P<us>[\d.]+):", out, re.M)
    )
    names = [layout.split("=")[0] for layout in layouts]
    assert set(medians) == {(w, n) for w in row_cost.WORK for n in names}
    assert all(us > 0 for us in medians.values())
