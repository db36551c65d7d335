"""Sub-workflows (``workflow:`` as a task, issue 19, SPEC 7.3) against real PostgreSQL.

Every guarantee is counted in the database: child runs per (task, attempt), their links both
ways, task states and results.
"""

from __future__ import annotations

import threading
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
from flowforge.store import queries
from flowforge.store.children import _start
from flowforge.store.db import Database
from flowforge.store.part import Tx
from flowforge.views import run_dict
from tests.helpers import bury, claim_task, drain, race, task_ids, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ONCE = RetryPolicy(max_attempts=1)
TWICE = RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)

#: the child: c1 → (c2, c3); its leaves c2 and c3 make its result
INVOICING = WorkflowDef(
    "invoicing",
    (
        TaskDef("c1", "tests.noop"),
        TaskDef("c2", "tests.noop", depends_on=("c1",)),
        TaskDef("c3", "tests.noop", depends_on=("c1",)),
    ),
)
#: the parent: approve → invoice (a child run of invoicing) → ship
ORDER = WorkflowDef(
    "order",
    (
        TaskDef("approve", "tests.noop"),
        TaskDef(
            "invoice",
            workflow="invoicing",
            depends_on=("approve",),
            input={"order": "{order}", "amount": "{upstream[approve][amount]}", "n": 1},
        ),
        TaskDef("ship", "tests.noop", depends_on=("invoice",)),
    ),
)
FLAKY_CHILD = WorkflowDef("flaky", (TaskDef("only", "tests.noop"),))
RETRIED = WorkflowDef("retried", (TaskDef("call", workflow="flaky", retry=TWICE),))


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def children_of(sql: Sql, task_run_id: uuid.UUID) -> list[tuple[uuid.UUID, int]]:
    """(child run, attempt) of every child run a task started, by attempt."""
    rows = sql.execute(
        "SELECT id, parent_attempt FROM workflow_runs WHERE parent_task_id = %s"
        " ORDER BY parent_attempt",
        (task_run_id,),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def waiting_on_a_lock(sql: Sql) -> bool:
    """Whether a session of this test's database waits for another transaction."""
    return bool(
        scalar(
            sql,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
    )


def succeed(repo: Store, sql: Sql, task_run_id: uuid.UUID, result: Any = None) -> None:
    claim = claim_task(repo, sql, task_run_id)
    assert repo.finish(task_run_id, claim.fencing_token, TaskState.SUCCEEDED, result=result)


def register(repo: Store, *workflows: WorkflowDef) -> None:
    repo.register_workflows(list(workflows))


def started_retried(repo: Store, sql: Sql) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A RETRIED run whose ``call`` task has started its first child: (run, call, child)."""
    register(repo, FLAKY_CHILD)
    run_id = repo.trigger(RETRIED, {}).run_id
    call = task_ids(repo, run_id)["call"]
    drain(repo)
    [(child, _)] = children_of(sql, call)
    return run_id, call, child


def test_a_child_run_is_created_once_linked_both_ways_and_its_leaves_are_the_result(
    repo: Store, sql: Sql
) -> None:
    register(repo, INVOICING)
    run_id = repo.trigger(ORDER, {"order": {"id": 7}}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    assert repo.get_task(ids["invoice"]).state is TaskState.PENDING  # waits for approve
    succeed(repo, sql, ids["approve"], {"amount": 12.5})
    drain(repo)
    drain(repo)  # a repeat starts nothing more
    invoice = repo.get_task(ids["invoice"])
    assert invoice.state is TaskState.RUNNING and invoice.attempt == 1
    assert invoice.lease_owner is None and invoice.child_workflow == "invoicing"
    [(child_id, attempt)] = children_of(sql, ids["invoice"])
    assert attempt == 1 and invoice.child_run_id == child_id
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["invoice"]) == 0
    child = repo.get_run(child_id)
    assert child.workflow == "invoicing" and child.input == {
        "order": {"id": 7},
        "amount": 12.5,
        "n": 1,
    }
    assert (child.parent_run_id, child.parent_task_id) == (run_id, ids["invoice"])
    assert scalar(sql, "SELECT depth FROM workflow_runs WHERE id = %s", child_id) == 1
    parent = repo.get_run(run_id)
    assert [(c.task, c.run_id, c.attempt) for c in parent.children] == [("invoice", child_id, 1)]
    shown = run_dict(parent)
    assert shown["children"][0]["run_id"] == child_id
    assert shown["tasks"][1]["child_run_id"] == child_id
    assert run_dict(child)["parent_run_id"] == run_id
    kids = task_ids(repo, child_id)
    succeed(repo, sql, kids["c1"], "one")
    succeed(repo, sql, kids["c2"], {"two": 2})
    succeed(repo, sql, kids["c3"], [3])
    drain(repo)
    assert repo.get_run(child_id).state is RunState.SUCCEEDED
    invoice = repo.get_task(ids["invoice"])
    assert invoice.state is TaskState.SUCCEEDED
    assert invoice.result == {"c2": {"two": 2}, "c3": [3]}
    assert repo.get_task(ids["ship"]).state is TaskState.READY  # released as a finish does
    ship = claim_task(repo, sql, ids["ship"])
    assert ship.upstream == {"invoice": {"c2": {"two": 2}, "c3": [3]}}
    assert repo.get_run(child_id).state is RunState.SUCCEEDED
    assert len(children_of(sql, ids["invoice"])) == 1


def test_without_input_the_child_gets_the_run_input(repo: Store, sql: Sql) -> None:
    register(repo, FLAKY_CHILD)
    run_id = repo.trigger(RETRIED, {"x": [1, 2]}).run_id
    drain(repo)
    [(child_id, _)] = children_of(sql, task_ids(repo, run_id)["call"])
    assert repo.get_run(child_id).input == {"x": [1, 2]}


def test_a_failed_child_is_retried_with_a_new_child_per_attempt(repo: Store, sql: Sql) -> None:
    run_id, call, first = started_retried(repo, sql)
    bury(repo, sql, task_ids(repo, first)["only"])  # drains: the child FAILS, call retries
    drain(repo)
    assert repo.get_run(first).state is RunState.FAILED
    attempts = children_of(sql, call)
    assert [a for _, a in attempts] == [1, 2] and attempts[0][0] == first
    task = repo.get_task(call)
    assert task.state is TaskState.RUNNING and task.attempt == 2
    assert task.child_run_id == attempts[1][0]
    bury(repo, sql, task_ids(repo, attempts[1][0])["only"])
    drain(repo)
    task = repo.get_task(call)
    assert task.state is TaskState.DEAD
    assert task.failure_reason is FailureReason.MAX_ATTEMPTS_EXCEEDED
    assert task.last_error == f"child run {attempts[1][0]} FAILED"
    assert len(children_of(sql, call)) == 2  # no third child
    assert repo.get_run(run_id).state is RunState.FAILED


def test_a_requeued_child_task_starts_a_new_child(repo: Store, sql: Sql) -> None:
    register(repo, FLAKY_CHILD)
    once = WorkflowDef("once", (TaskDef("call", workflow="flaky", retry=ONCE),))
    run_id = repo.trigger(once, {}).run_id
    call = task_ids(repo, run_id)["call"]
    drain(repo)
    [(first, _)] = children_of(sql, call)
    bury(repo, sql, task_ids(repo, first)["only"])
    drain(repo)
    dead = repo.get_task(call)
    assert dead.state is TaskState.DEAD  # its one attempt used up
    assert dead.failure_reason is FailureReason.MAX_ATTEMPTS_EXCEEDED
    repo.requeue_dead(call, "alice", "child fixed")
    drain(repo)
    attempts = children_of(sql, call)
    assert [a for _, a in attempts] == [1, 2] and attempts[1][0] != first
    assert repo.get_run(first).state is RunState.FAILED  # the old child is left as it ended


def test_a_child_cancelled_by_someone_else_kills_its_task(repo: Store, sql: Sql) -> None:
    run_id, call, child = started_retried(repo, sql)
    repo.cancel_run(child)
    drain(repo)
    task = repo.get_task(call)
    assert task.state is TaskState.DEAD
    assert task.failure_reason is FailureReason.CHILD_CANCELLED  # no retry after a cancel
    assert len(children_of(sql, call)) == 1
    assert repo.get_run(run_id).state is RunState.FAILED


def test_cancelling_the_parent_cancels_children_and_grandchildren(repo: Store, sql: Sql) -> None:
    leaf = WorkflowDef("leaf", (TaskDef("work", "tests.noop"), TaskDef("after", "tests.noop")))
    middle = WorkflowDef("middle", (TaskDef("down", workflow="leaf"),))
    top = WorkflowDef("top", (TaskDef("down", workflow="middle"),))
    register(repo, leaf, middle)
    run_id = repo.trigger(top, {}).run_id
    drain(repo)
    [(mid_run, _)] = children_of(sql, task_ids(repo, run_id)["down"])
    drain(repo)
    [(leaf_run, _)] = children_of(sql, task_ids(repo, mid_run)["down"])
    leaf_ids = task_ids(repo, leaf_run)
    claim = claim_task(repo, sql, leaf_ids["work"])  # a handler runs in the grandchild
    repo.cancel_run(run_id)
    assert repo.get_task(task_ids(repo, run_id)["down"]).state is TaskState.CANCELLED
    assert repo.get_task(task_ids(repo, mid_run)["down"]).state is TaskState.CANCELLED
    assert repo.get_task(leaf_ids["after"]).state is TaskState.CANCELLED
    assert repo.get_task(leaf_ids["work"]).cancel_requested  # its worker is asked to stop
    assert repo.get_run(run_id).state is RunState.CANCELLED
    assert repo.get_run(mid_run).state is RunState.CANCELLED
    assert repo.get_run(leaf_run).cancel_requested
    assert repo.finish(leaf_ids["work"], claim.fencing_token, TaskState.CANCELLED)
    drain(repo)
    assert repo.get_run(leaf_run).state is RunState.CANCELLED
    assert scalar(sql, "SELECT count(*) FROM workflow_runs") == 3  # nothing new started


def test_a_deadline_or_fail_fast_of_the_parent_cancels_its_child(repo: Store, sql: Sql) -> None:
    register(repo, FLAKY_CHILD)
    both = WorkflowDef(
        "both", (TaskDef("call", workflow="flaky"), TaskDef("boom", "tests.noop")), fail_fast=True
    )
    run_id = repo.trigger(both, {}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    [(child, _)] = children_of(sql, ids["call"])
    bury(repo, sql, ids["boom"])  # fail-fast: the running child task is cancelled
    drain(repo)
    assert repo.get_task(ids["call"]).state is TaskState.CANCELLED
    assert repo.get_run(child).state is RunState.CANCELLED
    assert repo.get_run(run_id).state is RunState.FAILED


def test_an_unknown_child_workflow_at_run_time_is_dead(repo: Store, sql: Sql) -> None:
    lost = WorkflowDef(
        "lost",
        (TaskDef("call", workflow="nowhere"), TaskDef("next", "tests.noop", depends_on=("call",))),
    )
    run_id = repo.trigger(lost, {}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    task = repo.get_task(ids["call"])
    assert task.state is TaskState.DEAD
    assert task.failure_reason is FailureReason.CHILD_WORKFLOW_UNKNOWN
    assert "nowhere" in (task.last_error or "")
    assert repo.get_task(ids["next"]).state is TaskState.CANCELLED
    assert scalar(sql, "SELECT count(*) FROM workflow_runs") == 1
    assert repo.get_run(run_id).state is RunState.FAILED


def test_an_input_that_cannot_be_rendered_is_dead_child_input_error(repo: Store, sql: Sql) -> None:
    register(repo, FLAKY_CHILD)
    wf = WorkflowDef("needs", (TaskDef("call", workflow="flaky", input={"o": "{order[id]}"}),))
    run_id = repo.trigger(wf, {"order": {}}).run_id
    drain(repo)
    task = repo.get_task(task_ids(repo, run_id)["call"])
    assert task.state is TaskState.DEAD
    assert task.failure_reason is FailureReason.CHILD_INPUT_ERROR
    assert scalar(sql, "SELECT count(*) FROM workflow_runs") == 1


def test_recursion_at_run_time_stops_at_the_nesting_bound(repo: Store, sql: Sql) -> None:
    # a -> b -> a: refused by `workflows validate`, but definitions made in Python are not
    # checked against each other; the bound stops them
    ping = WorkflowDef("ping", (TaskDef("call", workflow="pong", retry=ONCE),))
    pong = WorkflowDef("pong", (TaskDef("call", workflow="ping", retry=ONCE),))
    register(repo, ping, pong)
    run_id = repo.trigger(ping, {}).run_id
    drain(repo, max_passes=200)
    assert scalar(sql, "SELECT max(depth) FROM workflow_runs") == 10
    assert scalar(sql, "SELECT count(*) FROM workflow_runs") == 11
    reasons = sql.execute("SELECT DISTINCT failure_reason FROM task_runs ORDER BY 1").fetchall()
    # the deepest dies of the bound, each level above of its failed child (one attempt each)
    assert [r[0] for r in reasons] == ["child_depth_exceeded", "max_attempts_exceeded"]
    assert repo.get_run(run_id).state is RunState.FAILED


def test_two_schedulers_racing_over_20_child_tasks_start_one_child_each(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    register(repo, FLAKY_CHILD)
    wide = WorkflowDef("wide", tuple(TaskDef(f"c{i}", workflow="flaky") for i in range(20)))
    run_id = repo.trigger(wide, {}).run_id

    def start(store: Store) -> int:
        return sum(store.start_children(3) for _ in range(20))

    counts = race(clean_database_url, start, start)  # two schedulers, own pools
    assert sum(counts) == 20  # each task started by exactly one racer
    per_task = sql.execute(
        "SELECT parent_task_id, count(*) FROM workflow_runs WHERE parent_run_id = %s GROUP BY 1",
        (run_id,),
    ).fetchall()
    assert len(per_task) == 20 and {n for _, n in per_task} == {1}
    assert repo.start_children(100) == 0


def test_the_database_refuses_a_second_child_for_one_attempt(repo: Store, sql: Sql) -> None:
    _run_id, _call, child = started_retried(repo, sql)
    with pytest.raises(psycopg.errors.UniqueViolation):
        sql.execute(
            "INSERT INTO workflow_runs (id, workflow, workflow_digest, input, fail_fast,"
            " parent_run_id, parent_task_id, parent_attempt, depth)"
            " SELECT gen_random_uuid(), workflow, workflow_digest, input, fail_fast,"
            " parent_run_id, parent_task_id, parent_attempt, depth"
            " FROM workflow_runs WHERE id = %s",
            (child,),
        )


def test_a_child_run_deleted_before_its_task_settled_fails_the_attempt(
    repo: Store, sql: Sql
) -> None:
    _run_id, call, first = started_retried(repo, sql)
    sql.execute("DELETE FROM workflow_runs WHERE id = %s", (first,))  # purge --dead, say
    drain(repo)
    task = repo.get_task(call)
    assert task.state is TaskState.RUNNING and task.attempt == 2  # retried: a new child
    assert [a for _, a in children_of(sql, call)] == [2]
    assert task.last_error == f"child run {first} is gone (deleted)"  # the first attempt's


def test_a_cancel_waiting_on_a_child_start_cancels_the_child_it_started(
    repo: Store, sql: Sql, db: Database
) -> None:
    register(repo, FLAKY_CHILD)
    run_id = repo.trigger(RETRIED, {}).run_id
    call = task_ids(repo, run_id)["call"]
    cancelled: list[RunState] = []
    with db.transaction() as cur:  # a start_children transaction, held open
        assert _start(Tx(cur, queries.load()), 10, []) == 1
        canceller = threading.Thread(target=lambda: cancelled.append(repo.cancel_run(run_id).state))
        canceller.start()
        wait_for(lambda: waiting_on_a_lock(sql), what="the cancel to wait for the task row")
    canceller.join(timeout=30)
    assert cancelled == [RunState.CANCELLED]
    [(child, _)] = children_of(sql, call)  # the child the start committed
    assert repo.get_task(call).state is TaskState.CANCELLED
    assert repo.get_run(child).state is RunState.CANCELLED  # cancelled with it, not orphaned


def test_the_scheduler_registers_what_it_loaded_so_any_trigger_finds_the_child(
    repo: Store, sql: Sql, clean_database_url: str, tmp_path: Path
) -> None:
    flows = tmp_path / "workflows"
    flows.mkdir()
    (flows / "flaky.yaml").write_text("name: flaky\ntasks: [{name: only, handler: tests.noop}]\n")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"database: {{url: '{clean_database_url}'}}\nworkflows: ['{flows}']\n")
    scheduler = Scheduler(load_config(config_file, env={}))
    scheduler.initialize()
    try:
        run_id = repo.trigger(RETRIED, {}).run_id  # registers only its own definition
        while scheduler.run_pass().total:
            pass
    finally:
        scheduler.shutdown()
    [(child, _)] = children_of(sql, task_ids(repo, run_id)["call"])
    assert repo.get_run(child).workflow == "flaky"
    names = sql.execute("SELECT name FROM workflow_definitions ORDER BY name").fetchall()
    assert [n for (n,) in names] == ["flaky", "retried"]


def test_a_rerun_of_the_parent_starts_a_new_child_and_keeps_the_old_one(
    repo: Store, sql: Sql
) -> None:
    run_id, call, first = started_retried(repo, sql)
    repo.cancel_run(first)  # the child cancelled by hand: the task dies, the parent FAILS
    drain(repo)
    assert repo.get_run(run_id).state is RunState.FAILED
    repo.rerun(run_id, "alice", "child fixed")
    drain(repo)
    attempts = children_of(sql, call)
    assert [a for _, a in attempts] == [1, 2] and attempts[0][0] == first
    assert repo.get_task(call).child_run_id == attempts[1][0]
    assert repo.get_run(first).state is RunState.CANCELLED  # not reused, left as it ended
    succeed(repo, sql, task_ids(repo, attempts[1][0])["only"], "ok")
    drain(repo)
    assert repo.get_task(call).result == {"only": "ok"}
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


@pytest.mark.parametrize("action", ["cancel", "bury"])
def test_an_operator_ending_a_running_child_task_cancels_its_child_run(
    repo: Store, sql: Sql, action: str
) -> None:
    """`flowforge task cancel|bury` of a child-workflow task that is RUNNING (no worker holds
    it) ends it at once and cancels its child run, as a cancel of the parent run would."""
    register(repo, INVOICING)
    run_id = repo.trigger(ORDER, {"order": {"id": 1}}).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["approve"], {"amount": 1})
    drain(repo)
    [(child, _)] = children_of(sql, ids["invoice"])
    assert repo.get_task(ids["invoice"]).state is TaskState.RUNNING
    done = (repo.cancel_task if action == "cancel" else repo.bury_task)(
        ids["invoice"], "alice", "wrong invoice"
    )
    assert done.previous_state is TaskState.RUNNING
    drain(repo)
    invoice = repo.get_task(ids["invoice"])
    if action == "cancel":
        assert invoice.state is TaskState.CANCELLED
    else:
        assert invoice.state is TaskState.DEAD
        assert invoice.failure_reason is FailureReason.OPERATOR
    assert repo.get_run(child).state is RunState.CANCELLED
    states = sql.execute("SELECT DISTINCT state FROM task_runs WHERE run_id = %s", (child,))
    assert [r[0] for r in states.fetchall()] == ["CANCELLED"]
    assert repo.get_task(ids["ship"]).state is TaskState.CANCELLED
    assert (
        scalar(sql, "SELECT count(*) FROM task_audit WHERE task_run_id = %s", ids["invoice"]) == 1
    )


def test_retry_now_of_a_retrying_child_task_starts_its_next_child_at_once(
    repo: Store, sql: Sql
) -> None:
    """A child-workflow task waiting out its backoff is not made READY (no worker executes it):
    retry-now makes its retry due, and the scheduler's next pass starts attempt 2's child."""
    register(repo, FLAKY_CHILD)
    hour = RetryPolicy(max_attempts=2, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)
    slow = WorkflowDef("slow-retry", (TaskDef("call", workflow="flaky", retry=hour),))
    call = task_ids(repo, repo.trigger(slow, {}).run_id)["call"]
    drain(repo)
    [(first, _)] = children_of(sql, call)
    bury(repo, sql, task_ids(repo, first)["only"])
    drain(repo)
    assert repo.get_task(call).state is TaskState.RETRYING
    assert len(children_of(sql, call)) == 1  # its backoff is an hour
    done = repo.retry_task_now(call, "alice", "the child's fix is out")
    assert done.task.state is TaskState.RETRYING and done.task.retry_at is not None
    assert scalar(sql, "SELECT retry_at <= now() FROM task_runs WHERE id = %s", call) is True
    drain(repo)
    task = repo.get_task(call)
    assert task.state is TaskState.RUNNING and task.attempt == 2
    assert [a for _, a in children_of(sql, call)] == [1, 2]
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", call) == 0
    assert (
        scalar(sql, "SELECT new_state FROM task_audit WHERE task_run_id = %s", call) == "RETRYING"
    )


def test_a_child_runs_tasks_that_name_no_queue_go_where_the_parents_go(
    repo: Store, sql: Sql
) -> None:
    """Queues (SPEC 7.4) meet sub-workflows: the child run is triggered by a scheduler, not by
    a config, so its unnamed tasks take the parent's child task's queue — the queue the
    parent run's unnamed tasks got from the config that triggered it; a named one keeps its."""
    named = WorkflowDef(
        "named", (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop", queue="partner"))
    )
    register(repo, named)
    parent = WorkflowDef("p", (TaskDef("call", workflow="named"),))
    call = task_ids(repo, repo.trigger(parent, {}, queue="tenant-a").run_id)["call"]
    drain(repo)
    [(child, _)] = children_of(sql, call)
    queues = dict(sql.execute("SELECT name, queue FROM task_runs WHERE run_id = %s", (child,)))
    assert queues == {"a": "tenant-a", "b": "partner"}
    outbox = sql.execute(
        "SELECT t.name, o.queue FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " WHERE t.run_id = %s ORDER BY t.name",
        (child,),
    ).fetchall()
    assert outbox == [("a", "tenant-a"), ("b", "partner")]  # each dispatched to its queue


def test_a_reload_back_to_an_earlier_version_makes_children_of_it_again(
    repo: Store, sql: Sql
) -> None:
    """A scheduler's start (every SIGHUP) makes what it loaded the latest definitions, an
    earlier version too; a trigger of an older version (an api child not yet replaced) does
    not."""
    more = TaskDef("more", "tests.noop", depends_on=("only",))
    longer = WorkflowDef("flaky", (*FLAKY_CHILD.tasks, more))

    def child_digest() -> str:
        run_id = repo.trigger(RETRIED, {}).run_id
        drain(repo)
        [(child, _)] = children_of(sql, task_ids(repo, run_id)["call"])
        return str(scalar(sql, "SELECT workflow_digest FROM workflow_runs WHERE id = %s", child))

    register(repo, FLAKY_CHILD)
    register(repo, longer)  # a reload to the longer version
    repo.trigger(FLAKY_CHILD, {})  # the old version triggered: registered, but not the latest
    assert child_digest() == longer.digest
    register(repo, FLAKY_CHILD)  # a reload back to the first version
    assert child_digest() == FLAKY_CHILD.digest
