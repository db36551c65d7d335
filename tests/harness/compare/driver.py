"""``scripts/bench --compare``: FlowForge, Celery (no result backend; PostgreSQL's), Dramatiq and
Procrastinate on the same workloads, on the same PostgreSQL and RabbitMQ, one after another.

Workloads: ``--tasks`` single-task runs (5,000), a chain of ``--chain`` (200), a fan-out/join
``--fanout`` wide (1,000) where the tool has one. Every tool gets ``--workers`` worker processes
(4), its own scratch database and queue names, all removed after. FlowForge's figures come
from ``tests/harness/bench.py``'s own workloads on a ``flowforge up`` tree; each peer runs as
``python -m tests.harness.compare.<peer>`` in ``.venv-compare`` (created on demand from
PyPI with ``constraints.txt``'s pins; never FlowForge's ``.venv``) and prints its figures as
one JSON line. Nothing here asserts a figure: it prints one table, FlowForge's speed over each
peer's ("FlowForge/tool": above 1, FlowForge was faster), and merges the report into the JSON file
under ``"compare"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from tests.harness import CHECKOUT, bench
from tests.harness.resources import create_database, drop_database

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "constraints.txt"
VENV = CHECKOUT / ".venv-compare"
#: What the peers need; every version (and every dependency's) is pinned by CONSTRAINTS.
PACKAGES = ("celery", "SQLAlchemy", "psycopg[binary]", "dramatiq[rabbitmq]", "procrastinate")
#: A peer's whole run: its workers' start, three workloads and its cleanup.
PEER_SLACK_S = 120.0


@dataclass(frozen=True)
class Peer:
    """One column of the comparison: a peer module and the options that make it this variant."""

    name: str
    module: str
    options: tuple[str, ...] = ()


PEERS = (
    Peer("Celery, no result backend", "celery_bench", ("--backend", "none")),
    Peer("Celery, PostgreSQL results", "celery_bench", ("--backend", "postgresql")),
    Peer("Dramatiq", "dramatiq_bench"),
    Peer("Procrastinate", "procrastinate_bench"),
)


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    unit: str
    faster_is_higher: bool  # tasks/s: higher is faster; ms/hop: lower is


def workloads(settings: bench.Settings) -> tuple[Workload, ...]:
    return (
        Workload("single", f"{settings.tasks:,} single-task runs", "tasks/s", True),
        Workload("chain", f"chain of {settings.chain:,}", "ms/hop", False),
        Workload("fanout", f"fan-out/join {settings.fanout:,}", "tasks/s", True),
    )


# ---------------------------------------------------------------------------- the peers' venv


def install_commands(venv: Path) -> list[list[str]]:
    """The commands that make ``venv`` with the peers at their pinned versions."""
    python = str(venv / "bin" / "python")
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS), *PACKAGES],
    ]


def ensure_venv(venv: Path = VENV) -> Path:
    """``venv``'s python, the venv made or brought to CONSTRAINTS first when it was not (a stamp
    file holds the hash of what was installed). Raises ``RuntimeError`` with pip's last line."""
    stamp = venv / ".flowforge-compare"
    wanted = hashlib.sha256(CONSTRAINTS.read_bytes() + " ".join(PACKAGES).encode()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == wanted):
        for command in install_commands(venv)[0 if not venv.exists() else 1 :]:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"{' '.join(command[:4])} failed: {last}")
        stamp.write_text(wanted)
    return venv / "bin" / "python"


# ---------------------------------------------------------------------------- running


def peer_command(python: Path, peer: Peer, settings: bench.Settings, log: Path) -> list[str]:
    """The command line that runs ``peer`` (``common.parser``'s sizes)."""
    return [
        str(python),
        "-m",
        f"tests.harness.compare.{peer.module}",
        "--workers",
        str(settings.workers),
        "--tasks",
        str(settings.tasks),
        "--chain",
        str(settings.chain),
        "--fanout",
        str(settings.fanout),
        "--timeout",
        str(settings.timeout_s),
        "--log",
        str(log),
        *peer.options,
    ]


def peer_env(database_url: str, broker_url: str, queue: str) -> dict[str, str]:
    """The environment a peer and its workers run with (``common.ENV``): FlowForge's own
    variables left out, the peer's services in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "CMP_"))}
    return env | {
        "CMP_DATABASE_URL": database_url,
        "CMP_BROKER_URL": broker_url,
        "CMP_QUEUE": queue,
    }


def run_peer(
    python: Path, peer: Peer, settings: bench.Settings, server_url: str, broker_url: str, logs: Path
) -> dict[str, Any]:
    """Run one peer on a scratch database of its own (dropped after); its report, or
    ``{"error": ...}`` naming its log when it failed (the comparison goes on)."""
    log = logs / f"{peer.module}{'-'.join(('', *peer.options[1:]))}.log"
    # short: Procrastinate's LISTEN channel carries it, and PostgreSQL's names end at 63 bytes
    queue = f"ffcmp-{uuid.uuid4().hex[:10]}"
    url = create_database(server_url, "flowforge_compare")
    try:
        done = subprocess.run(
            peer_command(python, peer, settings, log),
            cwd=CHECKOUT,
            env=peer_env(url, broker_url, queue),
            capture_output=True,
            text=True,
            timeout=3 * settings.timeout_s + PEER_SLACK_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out (log: {log})"}
    finally:
        drop_database(server_url, url)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {cause(done.stderr)} (log: {log})"}
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def cause(stderr: str) -> str:
    """The line of a peer's stderr that says why it failed: the last exception's, or the last."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*: \S", line)]
    return (raised or lines or ["no output"])[-1]


def flowforge(settings: bench.Settings, server_url: str, broker_url: str) -> dict[str, Any]:
    """FlowForge's figures on a tree of ``settings.workers`` workers, measured by bench.py's
    own workloads (throughput, chain's mean hop, fan-out), in the peers' report shape."""

    def workload(repo: Any, conn: psycopg.Connection[Any], record: Callable[..., None]) -> None:
        record("single", "tasks/s", bench.throughput(repo, conn, settings)["tasks_per_s"])
        chain = bench.chain(repo, conn, settings.chain, settings.timeout_s)
        record("chain", "ms/hop", chain["mean_ms"], p50_ms=chain["p50_ms"])
        fanout = bench.fanout(repo, conn, settings.fanout, settings.timeout_s)
        record("fanout", "tasks/s", fanout["tasks_per_s"], wall_s=fanout["wall_s"])

    figures = bench.alone(server_url, broker_url, settings.workers, 1, workload)
    return {
        "tool": "FlowForge",
        "version": metadata.version("flowforge"),
        "processes": f"flowforge up, {settings.workers} workers",
        "single": {"tasks_per_s": figures["single"]["median"]},
        "chain": {"ms_per_hop": figures["chain"]["median"], "p50_ms": figures["chain"]["p50_ms"]},
        "fanout": {
            "tasks_per_s": figures["fanout"]["median"],
            "wall_s": figures["fanout"]["wall_s"],
        },
    }


# ---------------------------------------------------------------------------- the table


def figure(result: dict[str, Any], workload: Workload) -> float | None:
    """A tool's figure for ``workload`` in its unit; None when it has none (n/a, failed)."""
    value = result.get(workload.key, {}).get(
        "tasks_per_s" if workload.faster_is_higher else "ms_per_hop"
    )
    return float(value) if value is not None else None


def ratio(ours: float | None, theirs: float | None, faster_is_higher: bool) -> float | None:
    """FlowForge's speed over the peer's: above 1, FlowForge was faster."""
    if not ours or not theirs:
        return None
    return ours / theirs if faster_is_higher else theirs / ours


def rows(report: dict[str, Any], settings: bench.Settings) -> list[dict[str, Any]]:
    """One row per workload and tool: figure, unit, ratio, or why there is none."""
    ours = report["tools"]["FlowForge"]
    out = []
    for w in workloads(settings):
        for name, result in report["tools"].items():
            value = figure(result, w)
            why = result.get("error") or result.get(w.key, {}).get("na")
            out.append(
                {
                    "workload": w.title,
                    "tool": name,
                    "value": value,
                    "unit": w.unit,
                    "ratio": None
                    if name == "FlowForge"
                    else ratio(figure(ours, w), value, w.faster_is_higher),
                    "note": None if value is not None else f"n/a: {why}",
                }
            )
    return out


def table(table_rows: list[dict[str, Any]]) -> str:
    """The rows as text, a workload's title on its first row only."""
    lines = [f"{'workload':<26} {'tool':<28} {'figure':>10}  {'unit':<8} {'FlowForge/tool':>11}"]
    previous = None
    for r in table_rows:
        title = r["workload"] if r["workload"] != previous else ""
        previous = r["workload"]
        if r["value"] is None:
            lines.append(f"{title:<26} {r['tool']:<28} {r['note']}")
            continue
        times = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        lines.append(f"{title:<26} {r['tool']:<28} {r['value']:>10.1f}  {r['unit']:<8} {times:>11}")
    lines.append("FlowForge/tool: FlowForge's speed over the tool's (above 1: FlowForge faster)")
    return "\n".join(lines)


def save(path: Path, report: dict[str, Any]) -> None:
    """Merge ``report`` into the JSON file at ``path`` under ``"compare"`` (the bench's other
    figures, when the file holds them, stay)."""
    bench.merge_json(path, "compare", report)


def run(args: argparse.Namespace, settings: bench.Settings) -> int:
    """``scripts/bench --compare``: ``args`` are bench's (``--json``, the servers)."""
    try:
        python = ensure_venv()
    except (RuntimeError, OSError) as exc:
        print(f"scripts/bench --compare: could not make {VENV}: {exc}", file=sys.stderr)
        return 1
    logs = Path(tempfile.mkdtemp(prefix="flowforge-compare-"))
    with bench.service_urls(args) as (server_url, broker_url):
        with bench.fresh_database(server_url) as url:
            floors = bench.floors(url)
        report: dict[str, Any] = {
            "machine": bench.machine(server_url, broker_url),
            "floors": floors,
            "settings": {k: getattr(settings, k) for k in ("workers", "tasks", "chain", "fanout")},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tools": {"FlowForge": flowforge(settings, server_url, broker_url)},
        }
        for peer in PEERS:
            print(f"compare: {peer.name}", file=sys.stderr)
            report["tools"][peer.name] = run_peer(
                python, peer, settings, server_url, broker_url, logs
            )
    report["table"] = rows(report, settings)
    save(args.json, report)
    print(table(report["table"]))
    f = floors
    print(
        f"machine floors: PostgreSQL {f['postgresql_commits_per_s']} commits/s (one client),"
        f" Python loop {f['python_loop_ms']:.0f} ms; workers' logs in {logs}"
    )
    print(f'JSON written to {args.json} (under "compare")')
    return 0
