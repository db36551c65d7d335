"""A handler that prints 10 MB on a real tree (``flowforge up``: scheduler, publisher, two
workers), counted in PostgreSQL (issue 21, SPEC 7.5): its attempt keeps only the tail, within
``worker.log_capture_bytes``, with the rest counted as dropped; the tree is unharmed — the
tasks triggered beside it all succeed, each executed once, and no worker's memory grows with
what was printed. ``flowforge logs`` shows what a quiet attempt of the same handler kept:
``ctx.log``'s line, the handler's own ``logging`` record, its stdout and its stderr, once each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from tests import cli_runner
from tests.e2e import Stack
from tests.harness.resources import child_pids
from tests.helpers import wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real tree

Sql = psycopg.Connection[tuple[Any, ...]]

PRINTED_MB = 10
BESIDE = 40
LIMIT = 64 * 1024
DONE_S = 180.0
#: How much a worker's resident memory may grow while the 10 MB go through it (KiB).
RSS_GROWTH_KB = 40 * 1024


def worker_pids(tree: Tree) -> list[int]:
    found = []
    for pid in child_pids(tree.proc.pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"worker" in title:
            found.append(pid)
    return found


def rss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1])


def test_a_handler_printing_10_mb_keeps_a_bounded_tail_and_harms_nothing(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 2})
    loud = workflow_from_mapping({"name": "loud", "tasks": [{"name": "t", "handler": "e2e.talk"}]})
    quiet = workflow_from_mapping(
        {"name": "quiet", "tasks": [{"name": "t", "handler": "e2e.record"}]}
    )
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    wait_for(lambda: len(worker_pids(trees[0])) == 2, 30, 0.1, "two workers")
    workers = worker_pids(trees[0])
    baseline = {pid: rss_kb(pid) for pid in workers}
    peak = dict(baseline)
    with Client(load_config(config, env={}), [loud, quiet]) as client:
        loud_run = client.trigger("loud", {"print_mb": PRINTED_MB, "text": "done"}).run_id
        beside = [r.run_id for r in client.trigger_many("quiet", [{}] * BESIDE)]
        talked = client.trigger("loud", {"text": "quietly"}).run_id
    runs = [loud_run, *beside, talked]

    def all_succeeded() -> bool:
        for pid in workers:
            peak[pid] = max(peak[pid], rss_kb(pid))
        row = sql.execute(
            "SELECT count(*) FROM task_runs WHERE run_id = ANY(%s) AND state = 'SUCCEEDED'",
            (runs,),
        ).fetchone()
        return row is not None and row[0] == len(runs)

    started = time.monotonic()
    wait_for(all_succeeded, DONE_S, 0.1, "every run to succeed")
    elapsed_s = time.monotonic() - started
    executions = sql.execute(
        "SELECT count(*), count(DISTINCT task_run_id) FROM test_executions WHERE run_id = ANY(%s)",
        (runs,),
    ).fetchone()
    assert executions == (len(runs), len(runs)), "a task was lost or executed twice"
    row = sql.execute(
        "SELECT a.output, a.output_dropped, a.attempt, t.progress, t.progress_message"
        "  FROM task_attempts a JOIN task_runs t ON t.id = a.task_run_id"
        " WHERE t.run_id = %s",
        (loud_run,),
    ).fetchall()
    [(output, dropped, attempt, progress, message)] = row
    kept = output.encode()
    assert attempt == 1
    assert len(kept) <= LIMIT
    printed = PRINTED_MB * 1024 * 1024
    assert dropped + len(kept) >= printed  # every byte printed was kept or counted
    assert dropped >= printed - LIMIT
    lines = output.splitlines()
    assert set(lines[0]) == {"o"}  # whole lines kept: the cut fell between two
    assert "out done" in lines and "err done" in lines
    # records go to the tail at once, printed lines when the reader takes them (up to a pipe's
    # 64 KiB later): the 10 MB run's records were pushed out, so a quiet run shows them
    [talked_task] = sql.execute("SELECT id FROM task_runs WHERE run_id = %s", (talked,)).fetchone()
    shown = cli_runner.assert_ok(
        cli_runner.run(["-c", str(config), "logs", str(talked_task)], stack.env())
    )
    expected = ["INFO log quietly", "INFO logging quietly", "out quietly", "err quietly"]
    assert sorted(shown.splitlines()) == sorted(expected)  # ctx.log, logging, stdout, stderr
    assert (progress, message) == (0.4, "done")
    assert workers == worker_pids(trees[0]), "a worker was replaced"
    for pid in workers:
        assert peak[pid] - baseline[pid] < RSS_GROWTH_KB, (pid, baseline[pid], peak[pid])
    print(
        f"10 MB printed: {len(runs)} runs in {elapsed_s:.1f}s; worker RSS "
        + ", ".join(f"{baseline[p]}→{peak[p]} KiB" for p in workers)
    )
