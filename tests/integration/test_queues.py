"""Queues that route (issue 20, SPEC 7.4), statement by statement against real PostgreSQL and
RabbitMQ (the real-process proof: test_queues_processes.py, ``slow``):

- a task's queue is stored on its row and carried by its outbox row on every path that
  dispatches: a trigger, a dependent released by a finish, a retry promoted, a claim handed
  back, a lost dispatch sent again, a map's items;
- a finishing worker is offered only the dependents of its own queue: the others go out as
  messages, to their own queue;
- the publisher publishes each row to its queue, declaring a queue it has not declared yet;
- defaults: the client's trigger and a schedule's fire take the ``broker.queue`` of the
  config that triggers; a store-level trigger that names none leaves it unassigned (published
  to the publisher's own queue, as every row was before migration 0014);
- ``flowforge stats``/the overview count READY tasks and live consumers per queue, and
  ``/health/ready`` names a queue with READY tasks and no live consumer, in a 200;
- ``flowforge status`` shows each task's queue, ``flowforge workflows validate`` refuses a task
  whose queue a pool of this tree consumes without importing its handler.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.api.health import Checks
from flowforge.client import Client
from flowforge.config import BrokerConfig, load_config
from flowforge.definitions import workflow_from_mapping
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.names import BANDS, band_queue
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError
from flowforge.roles.publisher import Publisher
from tests.cli_runner import run_config
from tests.delivery import broker_channel
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, claim_task, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def routed() -> WorkflowDef:
    """``a`` (the trigger's queue) → ``b`` (queue ``partner``); ``c`` a root on ``partner``."""
    return WorkflowDef(
        "routed",
        (
            TaskDef("a", "tests.noop", retry=FAST_RETRY),
            TaskDef("b", "tests.noop", depends_on=("a",), queue="partner", retry=FAST_RETRY),
            TaskDef("c", "tests.noop", queue="partner", retry=FAST_RETRY),
        ),
    )


def queues(sql: Sql, run_id: UUID) -> dict[str, str | None]:
    """Each task's queue, by name."""
    found = sql.execute("SELECT name, queue FROM task_runs WHERE run_id = %s", (run_id,))
    return {str(name): queue for name, queue in found.fetchall()}


def outbox(sql: Sql, task_run_id: UUID) -> list[tuple[int, str | None]]:
    """(token, queue) of each outbox row of one task run, oldest first."""
    found = sql.execute(
        "SELECT fencing_token, queue FROM outbox WHERE task_run_id = %s ORDER BY id",
        (task_run_id,),
    )
    return [(int(token), queue) for token, queue in found.fetchall()]


def test_a_trigger_stores_each_task_queue_and_its_outbox_rows_carry_it(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(routed(), queue="tree-a").run_id
    assert queues(sql, run_id) == {"a": "tree-a", "b": "partner", "c": "partner"}
    ids = task_ids(repo, run_id)
    assert outbox(sql, ids["a"]) == [(0, "tree-a")]
    assert outbox(sql, ids["c"]) == [(0, "partner")]
    assert outbox(sql, ids["b"]) == []  # PENDING on a
    assert {t.name: t.queue for t in repo.get_run(run_id).tasks}["b"] == "partner"
    assert repo.get_task(ids["c"]).queue == "partner"


def test_a_finish_offers_its_worker_only_the_dependents_of_its_queue(repo: Store, sql: Sql) -> None:
    wf = WorkflowDef(
        "fan",
        (
            TaskDef("a", "tests.noop"),
            TaskDef("here", "tests.noop", depends_on=("a",)),
            TaskDef("there", "tests.noop", depends_on=("a",), queue="partner"),
        ),
    )
    ids = task_ids(repo, repo.trigger(wf, queue="tree-a").run_id)
    claim = claim_task(repo, sql, ids["a"])
    done = (ids["a"], claim.fencing_token, _succeeded())
    finished = repo.finish_many([done], offer=None, queue="tree-a")
    assert [task_run_id for task_run_id, _ in finished.ready] == [ids["here"]]
    # both got their outbox row: the one not offered goes out as a message, to partner
    assert outbox(sql, ids["here"]) == [(0, "tree-a")]
    assert outbox(sql, ids["there"]) == [(0, "partner")]


def _succeeded() -> Any:
    from flowforge.domain.model import Finish

    return Finish(TaskState.SUCCEEDED)


def test_a_retry_a_claim_handed_back_and_a_lost_dispatch_keep_their_queue(
    repo: Store, sql: Sql
) -> None:
    ids = task_ids(repo, repo.trigger(routed(), queue="tree-a").run_id)
    # a retry: FAILED → RETRYING → READY again, with a new outbox row on its queue
    claim = claim_task(repo, sql, ids["c"])
    repo.finish(ids["c"], claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR)
    drain(repo)
    assert [queue for _, queue in outbox(sql, ids["c"])] == ["partner", "partner"]
    # a claim handed back (its handler never started): READY with a fresh row on its queue
    claim = claim_task(repo, sql, ids["c"])
    assert repo.release_claims([(ids["c"], claim.fencing_token)]) == 1
    assert [queue for _, queue in outbox(sql, ids["c"])] == ["partner"] * 3
    # a lost dispatch: published long ago while a later one of its queue was claimed
    sql.execute(
        "UPDATE outbox SET published_at = now() - interval '1 hour'; "
        "UPDATE task_runs SET ready_at = now() - interval '1 hour' WHERE state = 'READY'"
    )
    later = repo.trigger(WorkflowDef("later", (TaskDef("x", "tests.noop", queue="partner"),)))
    x = task_ids(repo, later.run_id)["x"]
    claim_task(repo, sql, x)
    # judged only once a worker consumes partner: a queue nobody consumes moved past nothing
    assert repo.redispatch_lost(60.0, 10) == 0
    repo.register_process(uuid.uuid4(), "host", 1, "worker", queue="partner")
    assert repo.redispatch_lost(60.0, 10) == 1  # c (partner), not a (tree-a: nothing later)
    assert [queue for _, queue in outbox(sql, ids["c"])] == ["partner"] * 4
    assert outbox(sql, ids["a"]) == [(0, "tree-a")]


def test_a_map_passes_its_queue_to_its_items_and_their_dispatches(repo: Store, sql: Sql) -> None:
    wf = WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("each", "tests.noop", for_each="list", queue="partner"),
        ),
    )
    run_id = repo.trigger(wf, queue="tree-a").run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=[1, 2, 3])
    drain(repo)
    found = sql.execute(
        "SELECT t.queue, o.queue FROM task_runs t JOIN outbox o ON o.task_run_id = t.id"
        " WHERE t.map_id = %s",
        (ids["each"],),
    ).fetchall()
    assert found == [("partner", "partner")] * 3


def test_the_client_and_a_schedule_fill_in_the_queue_of_the_config_that_triggers(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    config = load_config(stack.config_path(), env={})
    wf = WorkflowDef("plain", (TaskDef("a", "tests.noop"),))
    with Client(config, [wf]) as client:
        run_id = client.trigger("plain").run_id
    assert queues(sql, run_id) == {"a": stack.queue}
    assert queues(sql, repo.trigger(wf).run_id) == {"a": None}  # the store's: unassigned
    every = workflow_from_mapping(
        {
            "name": "ticking",
            "tasks": [{"name": "a", "handler": "tests.noop"}],
            "schedules": [{"every": "1s", "name": "tick"}],
        }
    )
    repo.sync({"ticking": every})
    sql.execute("UPDATE schedules SET next_fire_at = now() - interval '1 second'")
    fired = repo.fire_due({"ticking": every}, 10, "tree-b")
    run = next(f.run_id for f in fired if f.run_id is not None)
    assert queues(sql, run) == {"a": "tree-b"}


@pytest.fixture
def extra_queue(stack: Stack) -> Iterator[str]:
    """A second queue on the stack's broker, deleted at the end."""
    name = f"{stack.queue}.partner"
    yield name
    with broker_channel(stack) as channel:
        for index in range(len(BANDS)):  # the queue and its priority bands
            channel.queue_delete(band_queue(name, index))


def depth(stack: Stack, queue: str) -> int:
    with broker_channel(stack) as channel:
        return int(channel.queue_declare(queue, passive=True).method.message_count)


def test_the_publisher_publishes_each_row_to_its_queue_declaring_it_first(
    stack: Stack, repo: Store, sql: Sql, extra_queue: str
) -> None:
    wf = WorkflowDef(
        "two",
        (TaskDef("here", "tests.noop"), TaskDef("there", "tests.noop", queue=extra_queue)),
    )
    repo.trigger(wf, queue=stack.queue)
    repo.trigger(wf)  # unassigned: "here" goes to the publisher's own broker.queue
    publisher = Publisher(load_config(stack.config_path(), env={}))
    publisher.initialize()
    try:
        assert publisher.sweep() == (4, 4)
    finally:
        publisher.shutdown()
    assert (depth(stack, stack.queue), depth(stack, extra_queue)) == (2, 2)
    with broker_channel(stack) as channel:
        method, _, body = channel.basic_get(extra_queue, auto_ack=True)
        assert method is not None
        names = {t.id: t.name for t in repo.get_run(_run_of(sql, body)).tasks}
        assert names[UUID(json.loads(body)["task_run_id"])] == "there"
    arguments = _queue_arguments(stack, extra_queue)
    assert arguments == {"x-queue-type": "quorum"}  # as every task queue: topology.py


def _run_of(sql: Sql, body: bytes) -> UUID:
    row = sql.execute(
        "SELECT run_id FROM task_runs WHERE id = %s", (json.loads(body)["task_run_id"],)
    ).fetchone()
    assert row is not None
    return UUID(str(row[0]))


def _queue_arguments(stack: Stack, queue: str) -> dict[str, Any]:
    """The declared arguments, by declaring the queue again with them: the broker refuses
    (406) a declaration whose arguments differ."""
    config = BrokerConfig(url=(stack.broker_url,), queue=queue)
    from flowforge.broker.topology import queue_arguments

    arguments = queue_arguments(config)
    with broker_channel(stack) as channel:
        channel.queue_declare(queue, durable=True, arguments=arguments)  # 406 if not the same
    return arguments


def test_stats_count_ready_tasks_and_consumers_per_queue_and_health_warns(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    repo.trigger(routed(), queue="tree-a")
    repo.trigger(WorkflowDef("plain", (TaskDef("a", "tests.noop"),)))
    host, pid = socket.gethostname(), os.getpid()
    for role, queue in (("worker", "tree-a"), ("worker", "tree-a"), ("scheduler", None)):
        repo.register_process(uuid.uuid4(), host, pid, role, queue)
    repo.register_process(uuid.uuid4(), host, pid, "publisher")
    loads = {q.queue: (q.ready, q.consumers) for q in repo.stats(3).queues}
    assert loads == {None: (1, 0), "tree-a": (1, 2), "partner": (1, 0)}
    checks = Checks(repo, BrokerConfig(url=(stack.broker_url,), queue=stack.queue))()
    assert checks["unserved_queues"] == ["partner"]
    assert {k: v for k, v in checks.items() if k != "unserved_queues"} == {
        "postgres": "ok",
        "rabbitmq": "error",  # the stack's queue was never declared: not this test's point
        "scheduler": "ok",
        "publisher": "ok",
        "worker": "ok",
    }
    overview = repo.overview(3, 15.0)
    assert [q.queue for q in overview.queues if q.unserved] == ["partner"]
    # a consumer on partner, and the warning is gone
    repo.register_process(uuid.uuid4(), host, pid, "worker", "partner")
    assert "unserved_queues" not in Checks(repo, BrokerConfig(url=(stack.broker_url,)))()


def test_status_shows_each_task_queue_and_stats_json_the_queues(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(routed(), queue="tree-a").run_id
    config = stack.config_path()
    status = run_config(config, "status", str(run_id))
    assert status.returncode == 0, status.stderr
    header, *rows = status.stdout.splitlines()[2:]
    # one word each, "-" when none
    assert header.split()[-3:] == ["QUEUE", "WAITING_ON", "PROGRESS"]
    assert sorted(r.split()[-3] for r in rows) == ["partner", "partner", "tree-a"]
    shown = json.loads(run_config(config, "status", str(run_id), "--json").stdout)
    assert {t["name"]: t["queue"] for t in shown["tasks"]} == {
        "a": "tree-a",
        "b": "partner",
        "c": "partner",
    }
    stats = json.loads(run_config(config, "stats", "--json").stdout)
    assert {q["queue"]: q["ready"] for q in stats["queues"]} == {"tree-a": 1, "partner": 1}
    assert sorted(stats["unserved_queues"]) == ["partner", "tree-a"]


def test_validate_refuses_a_task_whose_queue_pool_lacks_its_handler(
    stack: Stack, tmp_path: Path
) -> None:
    folder = tmp_path / "workflows"
    folder.mkdir()
    (folder / "wf.yaml").write_text(
        "name: wf\ntasks:\n"
        "  - {name: a, handler: e2e.record}\n"
        "  - {name: b, handler: e2e.record, queue: partner}\n"
    )
    pools = [
        {"queue": stack.queue, "workers": 1},
        {"queue": "partner", "handlers": ["tests.harness.bench_handlers"]},
    ]
    config = stack.config_path(
        workflows=[str(folder)],
        handlers=["tests.e2e_handlers", "tests.harness.bench_handlers"],
        processes={"pools": pools},
    )
    found = run_config(config, "workflows", "validate")
    assert found.returncode == 2, found.stdout
    assert found.stderr.strip().splitlines() == [
        "flowforge: workflow 'wf' task 'b': handler 'e2e.record' goes to queue 'partner', "
        "whose pool (processes.pools[1]) does not import it"
    ]
    pools[1]["handlers"] = ["tests.e2e_handlers"]
    config = stack.config_path(
        workflows=[str(folder)],
        handlers=["tests.e2e_handlers", "tests.harness.bench_handlers"],
        processes={"pools": pools},
    )
    assert run_config(config, "workflows", "validate").returncode == 0


def test_a_task_queue_of_another_type_holds_up_only_its_own_rows(
    stack: Stack, repo: Store, sql: Sql, extra_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    with broker_channel(stack) as channel:
        channel.queue_declare(extra_queue, durable=True)  # a classic queue, declared by hand
    # more rows than a sweep takes, oldest first: they must not hold up the one behind them
    refused = WorkflowDef("refused", (TaskDef("x", "tests.noop", queue=extra_queue),))
    repo.trigger_many(refused, [{}] * 4)
    fine = repo.trigger(WorkflowDef("fine", (TaskDef("y", "tests.noop"),)), queue=stack.queue)
    publisher = Publisher(load_config(stack.config_path(), env={}), batch_size=2)
    publisher.initialize()
    try:
        with pytest.raises(BrokerUnavailableError, match="refused; reconnecting"):
            publisher.sweep()  # the broker closed the channel: the role reconnects
        publisher.reset()
        publisher.initialize()
        assert publisher.sweep() == (1, 1)  # the other queue's row, past the refused ones
    finally:
        publisher.shutdown()
    [logged] = [r for r in caplog.records if getattr(r, "action", None) == "queue_refused"]
    assert extra_queue in logged.getMessage()
    assert "rabbitmqctl delete_queue" in logged.getMessage()  # the operator's steps
    pending = sql.execute(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND queue = %s", (extra_queue,)
    ).fetchone()
    assert pending == (4,)
    sent = sql.execute(
        "SELECT published_at IS NOT NULL FROM outbox WHERE task_run_id = %s",
        (task_ids(repo, fine.run_id)["y"],),
    ).fetchone()
    assert sent == (True,)
