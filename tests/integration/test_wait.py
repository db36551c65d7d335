"""``Client.wait`` and ``flowforge status --wait`` against real role processes: each final
state ends the wait with its exit code, a run that cannot finish in time ends it with exit 10
and the state it was in, and the handlers ran once each (counted in the database)."""

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


def test_each_final_state_ends_the_wait_with_its_exit_code(
    stack: Stack, repo: Store, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    stack.start_all(workers=1)
    config = stack.config_path()

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return cli_runner.run(["-c", str(config), "status", *args], stack.env())

    ok = repo.trigger(CHAIN, {}).run_id
    doomed = repo.trigger(DOOMED, {}).run_id
    stoppable = repo.trigger(STOPPABLE, {}).run_id
    later = repo.trigger(CHAIN, {}, delay=3600).run_id

    with Client(load_config(config)) as client:
        run = client.wait(ok, 60)
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

    failed = status(str(doomed), "--wait", "--timeout", "60")
    assert failed.returncode == exitcodes.RUN_FAILED, failed.stderr
    assert f"run {doomed}" in failed.stdout and "state FAILED" in failed.stdout
    assert failed.stderr == ""

    wait_for(
        lambda: repo.get_run(stoppable).task("a").state is TaskState.RUNNING,
        timeout=30,
        what="the stoppable task to run",
    )
    repo.cancel_run(stoppable)
    cancelled = status(str(stoppable), "--json", "--wait", "--timeout", "1m")
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
