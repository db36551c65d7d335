"""``Client.wait`` and ``flowforge status --wait`` against real role processes: each final
state ends the wait with its exit code, a run that cannot finish in time ends it with exit 10
and the state it was in, and the handlers ran once each (counted in the database).

Timing, for a loaded machine: every wait for the tree to make progress is bounded by
:data:`PROGRESS_S`, far above what it takes on a quiet one (seconds), so only a hang fails it;
the short timeouts (0.3 s, 1 s) are waits that must time out, on runs that cannot finish (one
delayed an hour). The worker is alone and runs sync handlers one at a time, so the run that
holds its handler until cancelled starts only once the chain has finished: triggered beside it,
a chain step released through the broker — which it is whenever the step before took longer
than the worker's turn with the broker (``PUMP_INTERVAL_S``, 1 s) — would queue behind it and
the chain's wait would time out. Leases are long enough (``LEASE_S``) that a starved worker
process cannot lose one and run a handler twice: this test counts executions, not leases."""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.client import Client
from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError, NotFoundError, WaitTimeoutError
from tests import cli_runner
from tests.cli_runner import assert_refused
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

CHAIN = WorkflowDef(
    "wait-chain", (TaskDef("a", "e2e.record"), TaskDef("b", "e2e.record", depends_on=("a",)))
)
DOOMED = WorkflowDef("wait-doomed", (TaskDef("a", "e2e.permanent"),))
STOPPABLE = WorkflowDef("wait-stoppable", (TaskDef("a", "e2e.honour_cancel"),))
UNKNOWN_ID = "00000000-0000-0000-0000-000000000000"
#: The bound of every wait for the tree to make progress (seconds): only a hang reaches it.
PROGRESS_S = 90
#: The worker's lease (seconds; tests/e2e.py's default is 3 s): renewed every 0.5 s all the same.
LEASE_S = 30.0


def test_each_final_state_ends_the_wait_with_its_exit_code(
    stack: Stack, repo: Store, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    stack.start_all(workers=1, worker={"lease_s": LEASE_S})
    config = stack.config_path()

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        # the command's own wait (at most PROGRESS_S) ends before the runner gives up on it
        command = ["-c", str(config), "status", *args]
        return cli_runner.run(command, stack.env(), timeout=PROGRESS_S + 60)

    ok = repo.trigger(CHAIN, {}).run_id
    doomed = repo.trigger(DOOMED, {}).run_id
    later = repo.trigger(CHAIN, {}, delay=3600).run_id

    with Client(load_config(config)) as client:
        run = client.wait(ok, PROGRESS_S)
        assert run.state is RunState.SUCCEEDED and run.finished_at is not None
        assert [t.state for t in run.tasks] == [TaskState.SUCCEEDED] * 2
        with pytest.raises(WaitTimeoutError) as raised:
            client.wait(later, 0.3)
        assert raised.value.run is not None and raised.value.run.state is RunState.SCHEDULED
        with pytest.raises(InputError):
            client.wait(ok, 0)
        with pytest.raises(NotFoundError):
            client.wait(UNKNOWN_ID, 5)
    executed = sql.execute(
        "SELECT task, count(*) FROM test_executions WHERE run_id = %s GROUP BY task ORDER BY 1",
        (ok,),
    ).fetchall()
    assert executed == [("a", 1), ("b", 1)]

    failed = status(str(doomed), "--wait", "--timeout", str(PROGRESS_S))
    assert failed.returncode == exitcodes.RUN_FAILED, failed.stderr
    assert f"run {doomed}" in failed.stdout and "state FAILED" in failed.stdout
    assert failed.stderr == ""

    # only now: its handler holds the only worker until cancelled (module docstring)
    stoppable = repo.trigger(STOPPABLE, {}).run_id
    wait_for(
        lambda: repo.get_run(stoppable).task("a").state is TaskState.RUNNING,
        timeout=PROGRESS_S,
        what="the stoppable task to run",
    )
    repo.cancel_run(stoppable)
    cancelled = status(str(stoppable), "--json", "--wait", "--timeout", f"{PROGRESS_S}s")
    assert cancelled.returncode == exitcodes.RUN_CANCELLED, cancelled.stderr
    assert json.loads(cancelled.stdout)["state"] == "CANCELLED"

    succeeded = status(str(ok), "--wait")
    assert succeeded.returncode == exitcodes.OK and "state SUCCEEDED" in succeeded.stdout

    timed_out = status(str(later), "--wait", "--timeout", "1")
    line = assert_refused(timed_out, exitcodes.WAIT_TIMEOUT, "is still SCHEDULED after waiting 1s")
    assert line.startswith(f"flowforge: run {later}")
    assert "state SCHEDULED" in timed_out.stdout  # what it was, shown as status shows it
    assert repo.get_run(later).state is RunState.SCHEDULED  # the run goes on

    assert_refused(status(UNKNOWN_ID, "--wait"), exitcodes.NOT_FOUND, UNKNOWN_ID)
    assert_refused(status("not-an-id", "--wait"), exitcodes.USAGE, "not-an-id")
