"""``scripts/bench --compare`` without its peers: the table and its ratios, the command lines the
driver runs, the peers' venv, the JSON it merges (tests/harness/compare). The comparison itself
is never run by the suite (docs/performance.md, "Compared in one run")."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness import bench
from tests.harness.compare import common, driver

SETTINGS = bench.Settings(workers=4, tasks=5000, chain=200, fanout=1000, timeout_s=600.0)


def report(**peers: dict[str, Any]) -> dict[str, Any]:
    ours = {
        "single": {"tasks_per_s": 2000.0},
        "chain": {"ms_per_hop": 4.0},
        "fanout": {"tasks_per_s": 1500.0},
    }
    return {"tools": {"FlowForge": ours, **peers}}


def test_the_ratio_is_flowforges_speed_over_the_peers_for_rates_and_for_times() -> None:
    assert driver.ratio(2000.0, 500.0, faster_is_higher=True) == 4.0
    assert driver.ratio(4.0, 8.0, faster_is_higher=False) == 2.0  # ms/hop: half the time
    assert driver.ratio(4.0, 2.0, faster_is_higher=False) == 0.5  # the peer was faster
    assert driver.ratio(2000.0, None, faster_is_higher=True) is None


def test_rows_give_each_workload_every_tool_with_its_ratio_or_why_it_has_none() -> None:
    peer = {
        "single": {"tasks_per_s": 500.0},
        "chain": {"ms_per_hop": 10.0},
        "fanout": {"na": "a chord needs a result backend"},
    }
    rows = driver.rows(report(Celery=peer, Broken={"error": "exit 1: boom"}), SETTINGS)
    by = {(r["workload"], r["tool"]): r for r in rows}
    assert len(rows) == 9  # 3 workloads x 3 tools
    single = by[("5,000 single-task runs", "Celery")]
    assert (single["value"], single["unit"], single["ratio"]) == (500.0, "tasks/s", 4.0)
    assert by[("chain of 200", "Celery")]["ratio"] == 2.5
    assert by[("chain of 200", "FlowForge")]["ratio"] is None
    assert by[("fan-out/join 1,000", "Celery")]["note"] == "n/a: a chord needs a result backend"
    assert by[("chain of 200", "Broken")]["note"] == "n/a: exit 1: boom"


def test_the_table_names_each_workload_once_and_prints_figures_ratios_and_reasons() -> None:
    peer = {"single": {"tasks_per_s": 500.0}, "chain": {"ms_per_hop": 10.0}, "fanout": {"na": "x"}}
    lines = driver.table(driver.rows(report(Celery=peer), SETTINGS)).splitlines()
    assert lines[0].split() == ["workload", "tool", "figure", "unit", "FlowForge/tool"]
    assert lines[1].split() == ["5,000", "single-task", "runs", "FlowForge", "2000.0", "tasks/s"]
    assert lines[2].split() == ["Celery", "500.0", "tasks/s", "4.00"]
    assert lines[4].split() == ["Celery", "10.0", "ms/hop", "2.50"]
    assert lines[6].split() == ["Celery", "n/a:", "x"]
    assert "above 1: FlowForge faster" in lines[-1]


@pytest.mark.parametrize("peer", driver.PEERS, ids=lambda p: p.name)
def test_each_peer_runs_as_its_module_in_the_peers_venv_with_the_sizes_it_parses(
    peer: driver.Peer,
) -> None:
    python = Path("/x/.venv-compare/bin/python")
    command = driver.peer_command(python, peer, SETTINGS, Path("/tmp/peer.log"))
    assert command[:3] == [str(python), "-m", f"tests.harness.compare.{peer.module}"]
    parser = common.parser(peer.module)
    parser.add_argument("--backend")  # celery_bench's own (its module needs Celery to import)
    args = parser.parse_args(command[3:])
    assert (args.workers, args.tasks, args.chain, args.fanout) == (4, 5000, 200, 1000)
    assert (args.timeout, args.log) == (600.0, Path("/tmp/peer.log"))
    assert args.backend == (peer.options[1] if peer.options else None)


def test_a_peer_gets_its_services_in_its_environment_and_none_of_flowforges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWFORGE_CONFIG", "/etc/flowforge.yaml")
    monkeypatch.setenv("CMP_QUEUE", "stale")
    env = driver.peer_env("dbname=x", "amqp://b", "ffcmp-1")
    assert {k: env[k] for k in common.ENV} == {
        "CMP_DATABASE_URL": "dbname=x",
        "CMP_BROKER_URL": "amqp://b",
        "CMP_QUEUE": "ffcmp-1",
    }
    assert not [k for k in env if k.startswith("FLOWFORGE_")]


def test_the_peers_venv_is_made_apart_with_every_package_pinned(tmp_path: Path) -> None:
    venv = tmp_path / ".venv-compare"
    make, install = driver.install_commands(venv)
    assert make[1:] == ["-m", "venv", str(venv)]
    assert install[:4] == [str(venv / "bin" / "python"), "-m", "pip", "install"]
    assert install[install.index("-c") + 1] == str(driver.CONSTRAINTS)
    assert driver.VENV != driver.CHECKOUT / ".venv"
    pins = {
        line.split("==")[0].lower()
        for line in driver.CONSTRAINTS.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for package in driver.PACKAGES:
        assert package.split("[")[0].lower() in pins, package
        assert package in install


def test_a_venv_installed_from_the_same_pins_is_used_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def run(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        if command[1:3] == ["-m", "venv"]:
            Path(command[3]).mkdir()
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(driver.subprocess, "run", run)
    venv = tmp_path / "v"
    assert driver.ensure_venv(venv) == venv / "bin" / "python"
    assert [c[1:3] for c in calls] == [["-m", "venv"], ["-m", "pip"]]
    driver.ensure_venv(venv)  # the stamp matches: nothing runs
    assert len(calls) == 2


def test_a_failed_install_says_why_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "Collecting x\nERROR: no network\n")

    monkeypatch.setattr(driver.subprocess, "run", run)
    with pytest.raises(RuntimeError, match=r"failed: ERROR: no network$"):
        driver.ensure_venv(tmp_path / "v")


def test_a_failed_peer_is_named_by_its_exception_line() -> None:
    stderr = (
        "Traceback (most recent call last):\n  File 'x.py', line 1\n"
        "psycopg.errors.InvalidParameterValue: channel name too long\n\n"
        "The above exception was the direct cause of the following exception:\n"
        "procrastinate.exceptions.ConnectorException: \n    Database error.\n"
    )
    assert driver.cause(stderr) == "psycopg.errors.InvalidParameterValue: channel name too long"
    assert driver.cause("") == "no output"


def test_the_report_is_merged_into_the_json_under_compare(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": {"throughput": {"median": 1}}}))
    driver.save(path, {"tools": {}})
    assert json.loads(path.read_text()) == {
        "results": {"throughput": {"median": 1}},
        "compare": {"tools": {}},
    }
    missing = tmp_path / "new.json"
    driver.save(missing, {"tools": {}})
    assert json.loads(missing.read_text()) == {"compare": {"tools": {}}}


def test_bench_compare_runs_the_driver_with_the_issues_fan_out_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bench.Settings] = []
    monkeypatch.setattr(driver, "run", lambda args, settings: seen.append(settings) or 0)
    assert bench.main(["--compare"]) == 0
    assert bench.main(["--compare", "--fanout", "300", "--tasks", "100"]) == 0
    assert bench.main(["--compare", "--quick"]) == 0
    assert [(s.tasks, s.chain, s.fanout) for s in seen] == [
        (5000, 200, 1000),
        (100, 200, 300),
        (300, 20, 200),
    ]


def test_peer_modules_import_no_flowforge_nor_harness_but_their_common_module() -> None:
    for name in ("common", "celery_bench", "dramatiq_bench", "procrastinate_bench"):
        path = driver.HERE / f"{name}.py"
        modules = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
        assert not [m for m in modules if m.startswith("flowforge")], name
        assert [m for m in modules if m.startswith("tests")] in ([], ["tests.harness.compare"])
