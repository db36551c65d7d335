"""Priorities (issue 20, SPEC 7.4; docs/flow-control.md "Priorities") against real PostgreSQL
and RabbitMQ (the real-process proof: test_priorities_processes.py, ``slow``):

- a task's priority (its workflow's, or the trigger's over it) is stored on its row and carried
  by its outbox row on the dispatch paths (a trigger, a dependent released, a retry, a claim
  handed back, a map's items), and a child run takes the priority its parent was triggered with;
- the publisher takes pending rows highest priority first and publishes each to its queue's
  band (``Q``, ``Q.p1``, ``Q.p5``), declared as quorum queues;
- a worker (in this process: the real consumer, claims and finishes) that works through a
  backlog of priority-0 tasks executes a priority-9 task triggered behind them before most of
  the backlog; the same task at priority 0 is executed after the whole backlog;
- a bad priority is refused by the client, the api (400, JSON naming it) and the CLI (one line,
  the input exit code), and nothing is created.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.client import Client
from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.names import BANDS, band_queue
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import InputError
from flowforge.roles.context import TaskContext
from flowforge.roles.publisher import Publisher
from flowforge.roles.runner import run_role
from flowforge.roles.worker import Worker
from tests.api_client import assert_json_error, serve_config, write_config
from tests.cli_runner import assert_refused, run_config
from tests.delivery import broker_channel
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, claim_task, drain, task_ids, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: The backlog of priority-0 tasks the priority-9 one is triggered behind.
BACKLOG = 300
#: broker.prefetch by default: the largest batch a worker claims at once.
PREFETCH = 16
#: Tasks executed before the late one is triggered: past the window's ramp to PREFETCH
#: (batches of 1, 2, 4, 8, then 16 from the 16th task on).
RAMPED = 2 * PREFETCH


def outbox(sql: Sql, task_run_id: UUID) -> list[tuple[int, str | None, int]]:
    """(token, queue, priority) of every outbox row of a task, oldest first."""
    found = sql.execute(
        "SELECT fencing_token, queue, priority FROM outbox WHERE task_run_id = %s ORDER BY id",
        (task_run_id,),
    )
    return [(int(r[0]), r[1], int(r[2])) for r in found.fetchall()]


def priorities(sql: Sql, run_id: UUID) -> dict[str, int]:
    found = sql.execute("SELECT name, priority FROM task_runs WHERE run_id = %s", (run_id,))
    return {str(r[0]): int(r[1]) for r in found.fetchall()}


def chain() -> WorkflowDef:
    return WorkflowDef(
        "chain",
        (
            TaskDef("a", "tests.noop", priority=3, retry=FAST_RETRY),
            TaskDef("b", "tests.noop", depends_on=("a",)),
        ),
    )


def test_a_task_priority_is_stored_and_carried_by_every_dispatch(repo: Store, sql: Sql) -> None:
    own = repo.trigger(chain()).run_id
    assert priorities(sql, own) == {"a": 3, "b": 0}
    ids = task_ids(repo, own)
    assert outbox(sql, ids["a"]) == [(0, None, 3)]
    # a retry: FAILED → RETRYING → READY, a new outbox row with the same priority
    claim = claim_task(repo, sql, ids["a"])
    repo.finish(ids["a"], claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR)
    drain(repo)
    assert [p for _, _, p in outbox(sql, ids["a"])] == [3, 3]
    # a claim handed back: READY with a fresh row, the same priority
    claim = claim_task(repo, sql, ids["a"])
    assert repo.release_claims([(ids["a"], claim.fencing_token)]) == 1
    assert [p for _, _, p in outbox(sql, ids["a"])] == [3, 3, 3]
    # the dependent released by the finish: its own priority (0)
    claim = claim_task(repo, sql, ids["a"])
    repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    assert outbox(sql, ids["b"]) == [(0, None, 0)]
    # a trigger's priority replaces every task's own, and is kept on the run
    urgent = repo.trigger(chain(), priority=9).run_id
    assert priorities(sql, urgent) == {"a": 9, "b": 9}
    row = sql.execute("SELECT priority FROM workflow_runs WHERE id = %s", (urgent,)).fetchone()
    assert row == (9,)


def test_a_map_passes_its_priority_to_its_items(repo: Store, sql: Sql) -> None:
    wf = WorkflowDef(
        "fan",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("each", "tests.noop", for_each="list", priority=6),
        ),
    )
    run = repo.trigger(wf).run_id
    ids = task_ids(repo, run)
    claim = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=[1, 2, 3])
    drain(repo)
    items = sql.execute(
        "SELECT t.priority, o.priority FROM task_runs t JOIN outbox o ON o.task_run_id = t.id"
        " WHERE t.map_id = %s",
        (ids["each"],),
    ).fetchall()
    assert items == [(6, 6)] * 3


def test_a_child_run_takes_the_priority_its_parent_was_triggered_with(
    repo: Store, sql: Sql
) -> None:
    child = WorkflowDef("kid", (TaskDef("k", "tests.noop", priority=2),))
    parent = WorkflowDef("mum", (TaskDef("start", workflow="kid"),))
    plain = repo.trigger(parent, children=[child]).run_id
    urgent = repo.trigger(parent, children=[child], priority=8).run_id
    drain(repo)  # the scheduler's pass starts the child runs
    found = sql.execute(
        "SELECT r.parent_run_id, t.priority FROM workflow_runs r JOIN task_runs t"
        " ON t.run_id = r.id WHERE r.parent_run_id IS NOT NULL"
    ).fetchall()
    assert dict(found) == {plain: 2, urgent: 8}  # none given: the child's own


def test_the_publisher_sends_the_highest_priority_first_each_to_its_band(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    wf = WorkflowDef("one", (TaskDef("only", "tests.noop"),))
    low = repo.trigger_many(wf, [{}] * 4, queue=stack.queue)
    mid = repo.trigger(wf, queue=stack.queue, priority=3)
    high = repo.trigger(wf, queue=stack.queue, priority=9)
    publisher = Publisher(load_config(stack.config_path(), env={}), batch_size=2)
    publisher.initialize()
    try:
        assert publisher.sweep() == (2, 2)  # the first sweep: the two highest
        published = sql.execute(
            "SELECT t.run_id FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
            " WHERE o.published_at IS NOT NULL"
        ).fetchall()
        assert {r[0] for r in published} == {mid.run_id, high.run_id}
        while publisher.sweep()[0]:
            pass
    finally:
        publisher.shutdown()
    try:
        with broker_channel(stack) as channel:
            depths = [
                int(
                    channel.queue_declare(
                        band_queue(stack.queue, i), passive=True
                    ).method.message_count
                )
                for i in range(len(BANDS))
            ]
            body = channel.basic_get(band_queue(stack.queue, 2), auto_ack=True)[2]
        assert depths == [len(low), 1, 1]
        assert body is not None
        assert repo.get_run(high.run_id).tasks[0].id == UUID(json.loads(body)["task_run_id"])
    finally:
        stack.delete_queue()


def test_a_priority_row_committed_while_a_sweep_awaits_its_confirms_joins_that_sweep(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """The priority lane: the row is committed (and NOTIFYs) after the sweep locked its batch
    and before its confirms are in; it goes out in that sweep, stamped after the sweep's own
    rows, in its band. A priority-0 row committed the same way waits for the next sweep."""
    wf = WorkflowDef("one", (TaskDef("only", "tests.noop"),))
    low = repo.trigger_many(wf, [{}] * 200, queue=stack.queue)
    publisher = Publisher(load_config(stack.config_path(), env={}), batch_size=500)
    publisher.initialize()
    late: list[UUID] = []
    real_send = publisher.send

    def send(batch: Any) -> Any:
        if not late:  # once the batch is locked: two more rows commit, and NOTIFY
            late.append(repo.trigger(wf, queue=stack.queue, priority=9).run_id)
            late.append(repo.trigger(wf, queue=stack.queue).run_id)
        return real_send(batch)

    publisher.send = send  # type: ignore[method-assign]
    try:
        assert publisher.sweep() == (201, 201)  # the 200 locked first, and the priority-9 row
        stamps = dict(
            sql.execute(
                "SELECT t.run_id, o.published_at FROM outbox o"
                " JOIN task_runs t ON t.id = o.task_run_id"
                " WHERE t.run_id = ANY(%s) OR t.run_id = %s",
                ([late[0], late[1]], low[0].run_id),
            ).fetchall()
        )
        assert stamps[late[1]] is None  # priority 0 is not above the sweep's lowest
        assert stamps[late[0]] > stamps[low[0].run_id]  # published after the sweep's rows
        assert publisher.sweep() == (1, 1)
    finally:
        publisher.shutdown()
    try:
        with broker_channel(stack) as channel:
            depths = [
                int(
                    channel.queue_declare(
                        band_queue(stack.queue, i), passive=True
                    ).method.message_count
                )
                for i in (0, 2)  # band p1 had no row: never declared
            ]
        assert depths == [201, 1]
    finally:
        stack.delete_queue()


def test_a_priority_9_task_behind_a_backlog_runs_before_most_of_it(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    urgent_at = run_behind_backlog(stack, repo, sql, priority=9, after=10)
    # the worker had started on the backlog; the urgent task overtook what was left of it
    assert urgent_at < BACKLOG // 4, urgent_at


def test_the_same_task_at_priority_0_runs_after_the_whole_backlog(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """The contrast that shows the previous test can fail: without a priority the late task
    waits for the backlog in FIFO order: it is in the last batch (a batch's claims share
    their ``started_at``, the claim's time, so its place within it is the tie-break's)."""
    assert run_behind_backlog(stack, repo, sql, priority=0, after=RAMPED) >= BACKLOG - PREFETCH


def run_behind_backlog(stack: Stack, repo: Store, sql: Sql, priority: int, after: int) -> int:
    """Trigger ``BACKLOG`` priority-0 tasks and publish them; start a worker (in a thread of
    this process: the real consumer, claims and finishes); once it has executed ``after`` of
    them, trigger one more task at ``priority`` and publish it. Return how many backlog tasks
    were executed before it (from ``task_attempts.started_at``).

    Order within a band is FIFO only while the worker's window stays put: a consumer restarted
    to change its prefetch (the ramp 1, 2, 4, … or a hand-back behind a slow handler) has the
    deliveries in flight requeued, behind what was published since (docs/flow-control.md
    "Priorities"). So the contrast's late task comes after the ramp, and ``fast_handler_ms``
    is out of reach of a loaded machine's stalls (in a CI run the contrast test saw 21 backlog
    tasks run after the late one)."""
    config = load_config(stack.config_path(worker={"fast_handler_ms": 60_000}), env={})
    wf = WorkflowDef("work", (TaskDef("only", "work", retry=FAST_RETRY),))
    started = threading.Event()
    done: list[str] = []

    def work(ctx: TaskContext) -> None:
        done.append(str(ctx.task_run_id))
        if len(done) == after:
            started.set()

    repo.trigger_many(wf, [{"n": n} for n in range(BACKLOG)], queue=stack.queue)
    publisher = Publisher(config)
    publisher.initialize()
    worker = Worker(config, handlers={"work": work})
    stop = threading.Event()
    thread = threading.Thread(target=run_role, args=(worker, stop), daemon=True)
    try:
        while publisher.sweep()[0]:
            pass
        thread.start()
        assert started.wait(30), "the worker executed nothing"
        late = repo.trigger(wf, {"late": True}, queue=stack.queue, priority=priority)
        while publisher.sweep()[0]:
            pass
        wait_for(lambda: len(done) == BACKLOG + 1, timeout=60, what="every task executed")
    finally:
        stop.set()
        thread.join(30)
        publisher.shutdown()
        stack.delete_queue()
    late_task = repo.get_run(late.run_id).tasks[0].id
    order = sql.execute(
        "SELECT task_run_id FROM task_attempts ORDER BY started_at, task_run_id"
    ).fetchall()
    return [r[0] for r in order].index(late_task)


# ---------------------------------------------------------------- bad priorities, every interface

BAD = [10, -1, True, 1.5, "5"]
CHAIN = "name: chain\ntasks:\n  - {name: a, handler: tests.noop, priority: 3}\n"


@pytest.fixture
def config(tmp_path: Path, clean_database_url: str) -> Path:
    return write_config(tmp_path, clean_database_url, {"chain.yaml": CHAIN})


def runs(sql: Sql) -> int:
    row = sql.execute("SELECT count(*) FROM workflow_runs").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("priority", BAD, ids=repr)
def test_the_client_refuses_a_bad_priority_and_creates_nothing(
    config: Path, sql: Sql, priority: Any
) -> None:
    with Client(load_config(config, env={})) as client:
        with pytest.raises(InputError, match="priority must be a whole number from 0 to 9"):
            client.trigger("chain", priority=priority)
        with pytest.raises(InputError, match="priority must be a whole number from 0 to 9"):
            client.trigger_many("chain", [{}], priority=priority)
        assert runs(sql) == 0
        run_id = client.trigger("chain", priority=7).run_id
        assert client.status(run_id).tasks[0].priority == 7


def test_the_cli_refuses_a_bad_priority_in_one_line(config: Path, sql: Sql) -> None:
    for text in ("10", "-1", "1.5", "high", "", " 5", "True"):
        found = run_config(config, "trigger", "chain", "--priority", text)
        assert_refused(found, exitcodes.USAGE, "--priority must be a whole number from 0 to 9")
    assert runs(sql) == 0
    found = run_config(config, "trigger", "chain", "--priority", "9")
    assert found.returncode == 0, found.stderr
    assert priorities(sql, UUID(found.stdout.strip())) == {"a": 9}


def test_the_api_refuses_a_bad_priority_with_a_400_naming_it(config: Path, sql: Sql) -> None:
    with serve_config(config) as api:
        for value in BAD:
            reply = api.post("/api/v1/runs", {"workflow": "chain", "priority": value})
            assert "priority must be a whole number from 0 to 9" in assert_json_error(reply, 400)
        assert runs(sql) == 0
        reply = api.post("/api/v1/runs", {"workflow": "chain", "priority": 6})
        assert reply.status == 201, reply.body
        assert [t["priority"] for t in reply.json()["tasks"]] == [6]
        reply = api.post("/api/v1/runs", {"workflow": "chain"})  # none: the task's own
        assert [t["priority"] for t in reply.json()["tasks"]] == [3]
