"""A run is terminal only when no task of it can still change (issue 15), against PostgreSQL.

Without fail-fast, a DEAD task beside tasks that still run or retry used to make the run FAILED
with no ``finished_at`` at once, and ``cancel`` then answered "run is FAILED". Now such a run is
RUNNING until every task has settled (SUCCEEDED, DEAD or CANCELLED); then it is FAILED with
``finished_at``. Cancelling it while it runs is accepted like any other running run, and
retention (which purges by ``finished_at``) leaves it alone.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from tests import cli_runner
from tests.e2e import REPO
from tests.helpers import claim_task, drain, expire_lease, stored_run, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: A retry waits an hour unless the test makes it due: RETRYING stays RETRYING meanwhile.
SLOW_RETRY = RetryPolicy(max_attempts=3, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)


def three_independent(fail_fast: bool) -> WorkflowDef:
    """x, y and z do not depend on each other."""
    return WorkflowDef(
        "three",
        tuple(TaskDef(name, "tests.noop", retry=SLOW_RETRY) for name in ("x", "y", "z")),
        fail_fast=fail_fast,
    )


def states(repo: Store, run_id: uuid.UUID) -> dict[str, TaskState]:
    return {t.name: t.state for t in repo.get_run(run_id).tasks}


def make_due(sql: Sql, task_id: uuid.UUID) -> None:
    changed = sql.execute(
        "UPDATE task_runs SET retry_at = now() WHERE id = %s AND state = 'RETRYING'", (task_id,)
    ).rowcount
    assert changed == 1


def dead_beside_running_and_retrying(repo: Store, sql: Sql) -> tuple[uuid.UUID, Any]:
    """A fail_fast: false run where x is DEAD, y RUNNING (claim returned) and z RETRYING."""
    run_id = repo.trigger(three_independent(fail_fast=False)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    x = claim_task(repo, sql, ids["x"])
    y = claim_task(repo, sql, ids["y"])
    z = claim_task(repo, sql, ids["z"])
    assert repo.finish(
        ids["z"], z.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    assert repo.finish(
        ids["x"], x.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR
    )
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "y": TaskState.RUNNING,
        "z": TaskState.RETRYING,
    }
    return run_id, y


def test_without_fail_fast_a_dead_task_beside_live_ones_leaves_the_run_running(
    repo: Store, sql: Sql
) -> None:
    run_id, _y = dead_beside_running_and_retrying(repo, sql)
    ids = task_ids(repo, run_id)
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert [r.id for r in repo.list_runs(state="RUNNING")] == [run_id]
    assert repo.list_runs(state="FAILED") == []

    # y's worker dies: reaped into RETRYING, the run still RUNNING
    expire_lease(sql, ids["y"])
    assert repo.reap_expired(10) == 1
    drain(repo)
    assert states(repo, run_id)["y"] is TaskState.RETRYING
    assert stored_run(sql, run_id) == ("RUNNING", False)

    # both retries run and succeed; the last success settles the run: FAILED, finished
    for name in ("y", "z"):
        make_due(sql, ids[name])
    drain(repo)
    for name in ("y", "z"):
        claim = claim_task(repo, sql, ids[name])
        assert repo.finish(ids[name], claim.fencing_token, TaskState.SUCCEEDED, result=name)
        drain(repo)
        if name == "y":
            assert stored_run(sql, run_id) == ("RUNNING", False)  # z can still change
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "y": TaskState.SUCCEEDED,
        "z": TaskState.SUCCEEDED,
    }


def test_cancelling_a_run_with_a_dead_task_and_live_ones_is_accepted(repo: Store, sql: Sql) -> None:
    run_id, y = dead_beside_running_and_retrying(repo, sql)
    ids = task_ids(repo, run_id)
    run = repo.cancel_run(run_id)
    assert run.cancel_requested and run.state is RunState.RUNNING and run.finished_at is None
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "y": TaskState.RUNNING,  # asked to stop, learns it at its next renewal
        "z": TaskState.CANCELLED,  # not executing: cancelled at once
    }
    renewal = repo.renew_lease(ids["y"], y.fencing_token, 30)
    assert renewal.held and renewal.cancel_requested
    assert repo.finish(ids["y"], y.fencing_token, TaskState.CANCELLED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.CANCELLED and run.finished_at is not None


def test_retention_keeps_a_run_whose_tasks_can_still_change(repo: Store, sql: Sql) -> None:
    run_id, _y = dead_beside_running_and_retrying(repo, sql)
    sql.execute(
        "UPDATE workflow_runs SET created_at = now() - interval '90 days' WHERE id = %s",
        (run_id,),
    )
    assert repo.purge(age_s=3600, limit=100) == 0
    assert stored_run(sql, run_id) == ("RUNNING", False)


def test_the_cli_cancels_such_a_run_and_says_what_it_waits_for(
    repo: Store, sql: Sql, clean_database_url: str, tmp_path: Path
) -> None:
    """Before: "run … is FAILED", as if the run were over and the cancel had done nothing."""
    run_id, _y = dead_beside_running_and_retrying(repo, sql)
    config = tmp_path / "flowforge.yaml"
    config.write_text("workflows: []\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    done = cli_runner.run(
        ["-c", str(config), "cancel", str(run_id)],
        {**env, "FLOWFORGE_DATABASE_URL": clean_database_url},
        cwd=REPO,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"run {run_id} is RUNNING: cancel requested, 1 running task(s) to stop\n"
    assert states(repo, run_id)["z"] is TaskState.CANCELLED
    assert stored_run(sql, run_id) == ("RUNNING", False)
