"""Reserved workers (docs/flow-control.md "Reserved workers") against real PostgreSQL and
RabbitMQ (the real-process proof: test_reserved_workers_processes.py, ``slow``):

- a reserved worker's consumer has the broker's priority: of a band's messages it gets the
  first ones while it has room (a quorum queue honours ``x-priority``), the others only the
  overflow;
- a reserved worker's finish offers it only the dependents at its ``min_priority`` or above:
  a lower one goes out as a message, to its band;
- with the plain worker held by a slow priority-0 handler, priority-9 tasks are run by the
  reserved worker (in this process: the real consumers, claims and finishes), which never
  runs a priority-0 task.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.broker.consume import Consumer
from flowforge.config import Config, load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Finish
from flowforge.domain.names import band, band_queue
from flowforge.domain.states import TaskState
from flowforge.roles.context import TaskContext
from flowforge.roles.publisher import Publisher
from flowforge.roles.runner import run_role
from flowforge.roles.worker import Worker
from tests.delivery import broker_channel
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, claim_task, task_ids, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def reserved(config: Config, low: int = 5) -> Config:
    return dataclasses.replace(config, worker=dataclasses.replace(config.worker, min_priority=low))


def test_the_reserved_consumer_gets_a_band_s_messages_first_while_it_has_room(
    stack: Stack,
) -> None:
    config = load_config(stack.config_path(), env={})
    first, plain = Consumer(config.broker, band(5)), Consumer(config.broker)
    first.connect()
    plain.connect()
    try:
        assert first.take(2, 0.0) == [] and plain.take(16, 0.0) == []  # both subscribed
        with broker_channel(stack) as channel:
            for n in range(3):
                channel.basic_publish("", band_queue(stack.queue, band(5)), b"%d" % n)
        got: dict[str, list[bytes]] = {"reserved": [], "plain": []}

        def collect() -> bool:
            got["reserved"] += [d.body for d in first.take(2, 0.05)]
            got["plain"] += [d.body for d in plain.take(16, 0.05)]
            return len(got["reserved"]) + len(got["plain"]) == 3

        wait_for(collect, timeout=10, what="three deliveries")
        # the reserved consumer's window (2) first, the overflow to the plain one
        assert got == {"reserved": [b"0", b"1"], "plain": [b"2"]}
    finally:
        first.close()
        plain.close()
        stack.delete_queue()


def chain() -> WorkflowDef:
    return WorkflowDef(
        "mixed",
        (
            TaskDef("a", "tests.noop", priority=9),
            TaskDef("urgent", "tests.noop", depends_on=("a",), priority=5),
            TaskDef("later", "tests.noop", depends_on=("a",)),  # priority 0
        ),
    )


@pytest.mark.parametrize(("low", "offered"), [(5, ["urgent"]), (0, ["later", "urgent"])])
def test_a_finish_offers_a_reserved_worker_only_the_dependents_of_its_bands(
    repo: Store, sql: Sql, low: int, offered: list[str]
) -> None:
    ids = task_ids(repo, repo.trigger(chain(), queue="tree-a").run_id)
    claim = claim_task(repo, sql, ids["a"])
    done = (ids["a"], claim.fencing_token, Finish(TaskState.SUCCEEDED))
    finished = repo.finish_many([done], offer=None, queue="tree-a", min_priority=low)
    names = {v: k for k, v in ids.items()}
    assert sorted(names[task_run_id] for task_run_id, _ in finished.ready) == offered
    # every dependent has its outbox row: the one not offered goes out as a message
    for name in ("urgent", "later"):
        row = sql.execute(
            "SELECT count(*) FROM outbox WHERE task_run_id = %s", (ids[name],)
        ).fetchone()
        assert row == (1,), name


def test_urgent_tasks_run_on_the_reserved_worker_while_a_slow_one_holds_the_other(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    config = load_config(stack.config_path(), env={})
    wf = WorkflowDef("work", (TaskDef("only", "work", retry=FAST_RETRY),))
    release, holding = threading.Event(), threading.Event()
    ran: dict[str, list[UUID]] = {"plain": [], "reserved": []}

    def handler(who: str) -> Any:
        def work(ctx: TaskContext) -> None:
            ran[who].append(ctx.task_run_id)
            if ctx.input.get("slow"):
                holding.set()
                assert release.wait(30), "never released"

        return work

    repo.trigger_many(wf, [{"slow": True, "n": n} for n in range(3)], queue=stack.queue)
    publisher = Publisher(config)
    publisher.initialize()
    workers = [
        Worker(config, handlers={"work": handler("plain")}),
        Worker(reserved(config), handlers={"work": handler("reserved")}),
    ]
    stop = threading.Event()
    # run_role, as a tree runs them: two workers declaring the same quorum queues at once can
    # have RabbitMQ 3.10 close one's connection (541, a consume on a queue whose Ra server the
    # other's declare is still starting), and a worker reconnects from that
    threads = [threading.Thread(target=run_role, args=(w, stop), daemon=True) for w in workers]
    try:
        while publisher.sweep()[0]:
            pass
        for thread in threads:
            thread.start()
        assert holding.wait(30), "the plain worker never started the slow task"
        urgent = [
            repo.trigger(wf, {"urgent": n}, queue=stack.queue, priority=9).run_id for n in range(3)
        ]
        while publisher.sweep()[0]:
            pass
        urgent_tasks = {repo.get_run(r).tasks[0].id for r in urgent}
        wait_for(
            lambda: urgent_tasks <= set(ran["reserved"]),
            timeout=30,
            what="the urgent tasks run by the reserved worker",
        )
        assert not release.is_set()  # the slow one still holds the plain worker
        release.set()
        wait_for(lambda: len(ran["plain"]) == 3, timeout=60, what="the slow tasks run")
    finally:
        release.set()
        stop.set()
        for thread in threads:
            thread.join(30)
        publisher.shutdown()
        stack.delete_queue()
    assert set(ran["reserved"]) == urgent_tasks  # never a priority-0 task
    executions = sql.execute(
        "SELECT count(*), count(DISTINCT task_run_id) FROM task_attempts"
    ).fetchone()
    assert executions == (6, 6)


def test_a_dead_reserved_consumer_s_deliveries_go_to_the_plain_one(stack: Stack) -> None:
    """Failure mode 96: a reserved worker that dies holding urgent deliveries (its connection
    closed, nothing acked) does not strand them: the broker requeues them and the plain
    consumer of the band gets them, marked redelivered."""
    config = load_config(stack.config_path(), env={})
    first, plain = Consumer(config.broker, band(5)), Consumer(config.broker)
    first.connect()
    plain.connect()
    try:
        assert first.take(2, 0.0) == [] and plain.take(1, 0.0) == []  # both subscribed
        with broker_channel(stack) as channel:
            for n in range(2):
                channel.basic_publish("", band_queue(stack.queue, band(5)), b"%d" % n)
        held: list[bytes] = []

        def reserved_holds_both() -> bool:
            held.extend(d.body for d in first.take(2, 0.05))
            return len(held) == 2

        wait_for(reserved_holds_both, timeout=10, what="the reserved consumer's window")
        first.close()  # dies without acking
        got: list[tuple[bytes, bool]] = []

        def plain_gets_both() -> bool:
            taken = plain.take(1, 0.05)
            got.extend((d.body, d.redelivered) for d in taken)
            plain.ack(taken)
            return len(got) == 2

        wait_for(plain_gets_both, timeout=10, what="the requeued deliveries")
        assert sorted(got) == [(b"0", True), (b"1", True)]
    finally:
        first.close()
        plain.close()
        stack.delete_queue()
