"""Handler errors, retries, deaths and cancellations each leave one log line (issue 15).

Through real role processes: the worker logs each failed attempt once at INFO (task run, run,
workflow/task, attempt, reason, the error's first line, escaped), the scheduler logs its retry
decision at INFO and the death at WARNING; no traceback reaches the log and successes stay
silent. Reaping an expired lease is proven through the repository's routing data and the
scheduler's own observer, with caplog.
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.roles.scheduler import Scheduler
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, claim_task, drain, expire_lease, task_ids, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

TWO_ATTEMPTS = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.05, jitter=Jitter.NONE)
LOUD = WorkflowDef(
    "loud",
    (
        TaskDef("charge", "e2e.fail_loud", retry=TWO_ATTEMPTS),
        TaskDef("note", "e2e.record"),
    ),
    fail_fast=False,
)


def lines_naming(text: str, task_run_id: uuid.UUID) -> list[str]:
    return [line for line in text.splitlines() if f"task run {task_run_id} " in line]


@pytest.mark.slow  # real role processes
def test_a_failing_task_leaves_one_line_per_attempt_retry_and_death(
    stack: Stack, repo: Store
) -> None:
    scheduler, _publisher, worker = stack.start_all(workers=1)
    run_id = repo.trigger(LOUD, {"order": 7}).run_id
    quiet = [repo.trigger(WorkflowDef("quiet", (TaskDef("ok", "e2e.record"),))).run_id]
    wait_for(
        lambda: (
            repo.get_run(run_id).state is RunState.FAILED
            and all(repo.get_run(r).state is RunState.SUCCEEDED for r in quiet)
        ),
        timeout=60,
        what="the loud run to fail and the quiet one to succeed",
    )
    ids = task_ids(repo, run_id)
    # the scheduler logs after its commit: the death line may trail the run's state a little
    wait_for(
        lambda: (
            lines_naming(scheduler.log(), ids["charge"])[-1:]
            and " is DEAD: " in lines_naming(scheduler.log(), ids["charge"])[-1]
        ),
        timeout=10,
        what="the scheduler's death line",
    )
    head = rf"task run {ids['charge']} \(run {run_id}, loud/charge, attempt"

    failed = lines_naming(worker.log(), ids["charge"])
    assert len(failed) == 2, failed
    for attempt, line in enumerate(failed, start=1):
        assert re.search(
            rf" INFO .*{head} {attempt}\) failed: handler_error: "
            rf"RuntimeError: card declined\\x1b\[31m on attempt {attempt}$",
            line,
        ), line
    routed = lines_naming(scheduler.log(), ids["charge"])
    assert len(routed) == 2, routed
    assert re.search(rf" INFO .*{head} 1\) will retry in 0\.05s: handler_error$", routed[0])
    assert re.search(rf" WARNING .*{head} 2\) is DEAD: max_attempts_exceeded$", routed[1])

    logs = scheduler.log() + worker.log()
    assert "Traceback" not in logs and "FORGED" not in logs and "\x1b" not in logs
    # successes are silent: neither the sibling nor the quiet run's task is named anywhere
    assert lines_naming(logs, ids["note"]) == []
    assert lines_naming(logs, task_ids(repo, quiet[0])["ok"]) == []


def test_the_scheduler_logs_a_reaped_lease_and_a_cancelled_failure_once_each(
    repo: Store, sql: Sql, clean_database_url: str, tmp_path: Path, caplog: Any
) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"database: {{url: '{clean_database_url}'}}\n")
    scheduler = Scheduler(load_config(config_file, env={}))
    workflow = WorkflowDef(
        "reaped",
        (TaskDef("slow", "tests.noop", retry=FAST_RETRY), TaskDef("other", "tests.noop")),
        fail_fast=False,
    )
    run_id = repo.trigger(workflow).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim_task(repo, sql, ids["slow"])
    other = claim_task(repo, sql, ids["other"])
    expire_lease(sql, ids["slow"])
    with caplog.at_level(logging.INFO, logger="flowforge.roles.scheduler"):
        assert repo.reap_expired(10, observe=scheduler._observe) == 1
        repo.cancel_run(run_id)
        assert repo.finish(
            ids["other"],
            other.fencing_token,
            TaskState.FAILED,
            reason=FailureReason.HANDLER_ERROR,
            error="x",
        )
        assert repo.route_failed(10, observe=scheduler._observe) == 1
    records = [r for r in caplog.records if r.name == "flowforge.roles.scheduler"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        (
            "INFO",
            f"task run {ids['slow']} (run {run_id}, reaped/slow, attempt 1) will retry in 0.00s:"
            " lease_expired",
        ),
        (
            "INFO",
            f"task run {ids['other']} (run {run_id}, reaped/other, attempt 1) cancelled: cancelled",
        ),
    ]
    reaped = records[0].__dict__
    assert (reaped["action"], reaped["task_run_id"], reaped["run_id"]) == (
        "task_retrying",
        str(ids["slow"]),
        str(run_id),
    )
    assert (reaped["workflow"], reaped["task"], reaped["attempt"], reaped["from_state"]) == (
        "reaped",
        "slow",
        1,
        "RUNNING",
    )
    assert all(r.exc_info is None for r in records)
