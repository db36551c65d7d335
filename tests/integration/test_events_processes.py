"""Events through real role processes (issue 19): two trees, and SIGKILLs of the processes
that deliver — a sender in the middle of its events, a scheduler that starts waits and hands
them the events stored before them; and 50 events for 50 waits sent at once from 4 processes.

Real ``flowforge role`` processes (tests/e2e.py ``Stack``) on the session database and broker;
counted in the database: one delivery row per task (its primary key), one execution of each
downstream handler (``test_executions``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

RUNS = 40
EARLY = 20  # events 0..19 are sent before their runs exist
PAYMENT = WorkflowDef(
    "payment-e2e",
    (
        TaskDef("settled", wait_for_event=EventWait("payment.settled", "{i}", 120.0)),
        TaskDef("after", "e2e.record", depends_on=("settled",)),
    ),
)
#: A sender process: events range(first, last, step) of payment.settled, paced so a SIGKILL
#: lands between two of them (or inside one: its transaction then rolls back whole); with a
#: start file, connected first and sending only once that file exists (at most 60 s).
SENDER = """
import os, sys, time
from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.events import Events
url, first, last, step, pause, start = sys.argv[1:7]
database = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1))
database.open()
events = Events(database)
deadline = time.monotonic() + 60
while start and not os.path.exists(start) and time.monotonic() < deadline:
    time.sleep(0.005)
for i in range(int(first), int(last), int(step)):
    events.send_event("payment.settled", str(i), {"i": i})
    time.sleep(float(pause))
"""


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def sender(
    stack: Stack, first: int, last: int, pause_s: float, step: int = 1, start: str = ""
) -> subprocess.Popen[bytes]:
    """A SENDER process (see there); ``start``: the file it waits for, if any."""
    args = [sys.executable, "-c", SENDER, stack.database_url, str(first), str(last), str(step)]
    return subprocess.Popen([*args, str(pause_s), start], env=stack.env())


def test_events_are_delivered_once_each_across_two_trees_and_sigkilled_deliverers(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    for i in range(EARLY):  # stored before any wait: delivered when the waits start
        repo.send_event("payment.settled", str(i), {"i": i})
    first_tree = stack.start_all(workers=1)
    stack.start_all(workers=1)  # the second tree
    runs = [r.run_id for r in repo.trigger_many(PAYMENT, [{"i": i} for i in range(RUNS)])]
    # the first tree's scheduler dies while the waits start and take the stored events
    first_tree[0].signal(signal.SIGKILL)
    first_tree[0].wait()
    wait_for(
        lambda: scalar(sql, "SELECT count(*) FROM event_deliveries") >= EARLY,
        timeout=30,
        what="the early events to be delivered",
    )
    wait_for(
        lambda: (
            scalar(
                sql,
                "SELECT count(*) FROM task_runs WHERE state = 'RUNNING' AND event_name IS NOT NULL",
            )
            == RUNS - EARLY
        ),
        timeout=30,
        what="the other waits to start",
    )
    # a sender is SIGKILLed in the middle of the late events ...
    killed = sender(stack, EARLY, RUNS, 0.05)
    try:
        wait_for(
            lambda: scalar(sql, "SELECT count(*) FROM event_deliveries") >= EARLY + 3,
            timeout=30,
            what="some late events",
        )
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
    # ... and another sends them all again: the waits it woke already stay woken once
    again = sender(stack, EARLY, RUNS, 0.0)
    assert again.wait(timeout=60) == 0
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.SUCCEEDED for r in runs),
        timeout=60,
        what="every run to succeed",
    )
    assert scalar(sql, "SELECT count(*) FROM event_deliveries") == RUNS
    assert scalar(sql, "SELECT count(DISTINCT task_run_id) FROM event_deliveries") == RUNS
    executed = sql.execute(
        "SELECT run_id, count(*) FROM test_executions GROUP BY run_id"
    ).fetchall()
    assert sorted(str(r) for r, _ in executed) == sorted(str(r) for r in runs)
    assert {n for _, n in executed} == {1}  # each downstream handler ran once
    for index, run_id in enumerate(runs):
        assert repo.get_run(run_id).task("settled").result == {"i": index}


def test_fifty_events_from_four_processes_wake_fifty_waits_once_each_across_two_trees(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    """Issue 19's proof: 50 waiting tasks, their 50 events sent at once from 4 sender
    processes (each its quarter, all released by one file), while two trees run."""
    stack.start_all(workers=1)
    stack.start_all(workers=1)  # the second tree
    runs = [r.run_id for r in repo.trigger_many(PAYMENT, [{"i": i} for i in range(50)])]
    wait_for(
        lambda: (
            scalar(
                sql, "SELECT count(*) FROM task_runs WHERE name = 'settled' AND state = 'RUNNING'"
            )
            == 50
        ),
        timeout=30,
        what="the 50 waits to start",
    )
    start = tmp_path / "start"
    senders = [sender(stack, part, 50, 0.0, step=4, start=str(start)) for part in range(4)]
    try:
        start.touch()  # the four connected senders go at once
        assert [s.wait(timeout=60) for s in senders] == [0, 0, 0, 0]
    finally:
        for process in senders:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.SUCCEEDED for r in runs),
        timeout=60,
        what="every run to succeed",
    )
    assert scalar(sql, "SELECT count(*) FROM events") == 50
    assert scalar(sql, "SELECT count(*) FROM event_deliveries") == 50
    assert scalar(sql, "SELECT count(DISTINCT task_run_id) FROM event_deliveries") == 50
    executed = dict(
        sql.execute("SELECT run_id, count(*) FROM test_executions GROUP BY run_id").fetchall()
    )
    assert executed == {r: 1 for r in runs}  # each downstream handler ran once
    for index, run_id in enumerate(runs):
        assert repo.get_run(run_id).task("settled").result == {"i": index}


SHORT = WorkflowDef(
    "timeout-e2e",
    (
        TaskDef("settled", wait_for_event=EventWait("payment.settled", "t{i}", 1.0)),
        TaskDef("after", "e2e.record", depends_on=("settled",)),
    ),
)


def test_killing_the_scheduler_while_waits_time_out_buries_each_once_and_wakes_none(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """The scheduler that starts waits and ends them at their timeout (one a pass: batch 1,
    so the 40 starts and timeouts spread over many passes) is SIGKILLed three times part-way:
    every wait ends DEAD event_timeout once, nothing downstream runs, no later event wakes."""
    stack.start("publisher")
    stack.start("worker")
    runs = [r.run_id for r in repo.trigger_many(SHORT, [{"i": i} for i in range(40)])]
    dead = "SELECT count(*) FROM task_runs WHERE name = 'settled' AND state = 'DEAD'"
    schedulers = []
    for round_ in range(3):
        schedulers.append(stack.start("scheduler", scheduler={"batch_size": 1}))
        target = (round_ + 1) * 10
        wait_for(lambda t=target: scalar(sql, dead) >= t, timeout=60, what=f"{target} timeouts")
        schedulers[-1].signal(signal.SIGKILL)
        schedulers[-1].wait()
    schedulers.append(stack.start("scheduler", scheduler={"batch_size": 1}))
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.FAILED for r in runs),
        timeout=60,
        what="every run to fail",
    )
    for run_id in runs:
        run = repo.get_run(run_id)
        settled, after = run.task("settled"), run.task("after")
        assert settled.state is TaskState.DEAD
        assert settled.failure_reason is FailureReason.EVENT_TIMEOUT
        assert after.state is TaskState.CANCELLED
    for i in range(40):  # too late: stored, wakes nothing
        assert repo.send_event("payment.settled", f"t{i}", {"i": i}).woke == ()
    assert scalar(sql, "SELECT count(*) FROM event_deliveries") == 0
    assert scalar(sql, "SELECT count(*) FROM test_executions") == 0
    # each timeout committed once: logged (after its commit) at most once across the schedulers
    # (a killed one may have committed its last timeout and died before logging it)
    logs = "".join(s.log() for s in schedulers)
    logged = [logs.count(f"of run {run_id}: no event") for run_id in runs]
    assert max(logged) == 1 and sum(logged) >= len(runs) - 3, logged
