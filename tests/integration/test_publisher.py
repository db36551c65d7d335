"""The publisher's sweeps in this process, against real PostgreSQL and RabbitMQ.

The publisher role is built from a test config (its own queue) and driven by calling
:meth:`Publisher.sweep`, so no role process is started. Proven here:

- a confirm the publisher never sees leaves the row pending, and the next sweep publishes and
  stamps it (at least once: both copies are on the queue; a worker runs the task once, proven
  with real processes in test_roles_delivery.py, ``slow``, and through the seams in
  tests/unit/test_worker_delivery.py);
- an unroutable publish (the queue deleted under the publisher) stamps nothing;
- two publishers sweeping at once divide the outbox: every row is published exactly once;
- a queue of another type than quorum stops the publisher and the consumer with the
  operator's steps (the exit code that follows: tests/unit/test_role_main.py).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.broker import messages
from flowforge.broker.consume import Consumer
from flowforge.broker.publish import ConfirmingPublisher
from flowforge.config import BrokerConfig, load_config
from flowforge.domain.model import Dispatch
from flowforge.errors import QueueTypeMismatchError
from flowforge.roles.publisher import Publisher
from tests.delivery import (
    broker_channel,
    outbox_rows,
    publish_twice_losing_the_first_confirm,
    queue_depth,
)
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, single, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Outbox rows in the two-publisher test, and rows per sweep (so each sweeps many times).
ROWS = 200
BATCH = 10
#: A bound on the publishers' meeting and on their sweeps, not a wait.
MEET_TIMEOUT_S = 10.0


def trigger_one(repo: Store) -> UUID:
    """A one-task run, READY with its outbox row; its task run id."""
    run_id = repo.trigger(single("publish", "e2e.record", retry=FAST_RETRY)).run_id
    return repo.get_run(run_id).tasks[0].id


@pytest.fixture
def make_publisher(stack: Stack) -> Iterator[Any]:
    """Publishers of the stack's config, initialized; all shut down at the end."""
    made: list[Publisher] = []

    def make(batch_size: int = 500) -> Publisher:
        publisher = Publisher(load_config(stack.config_path(), env={}), batch_size=batch_size)
        made.append(publisher)
        publisher.initialize()
        return publisher

    yield make
    for publisher in made:
        publisher.shutdown()


def test_a_lost_publisher_confirm_keeps_the_row_pending_and_the_next_sweep_stamps_it(
    stack: Stack,
    repo: Store,
    sql: Sql,
    make_publisher: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task_id = trigger_one(repo)
    publish_twice_losing_the_first_confirm(stack, sql, make_publisher(), task_id, monkeypatch)


def test_an_unroutable_publish_leaves_the_row_pending(stack: Stack, repo: Store, sql: Sql) -> None:
    task_id = trigger_one(repo)
    assert repo.promote_ready(10) == 0  # the trigger made it READY with its outbox row
    publisher = ConfirmingPublisher(BrokerConfig(url=(stack.broker_url,), queue=stack.queue))
    publisher.connect()  # declares the queue ...
    try:
        with broker_channel(stack) as channel:  # ... which an operator then deletes
            channel.queue_delete(stack.queue)
        assert repo.publish_outbox(10, publisher.publish) == (1, 0)
        assert outbox_rows(sql, task_id)[0][2] is None, "an unroutable message was stamped"

        publisher.close()
        publisher.connect()  # the queue exists again: the pending row is delivered
        assert repo.publish_outbox(10, publisher.publish) == (1, 1)
    finally:
        publisher.close()
    assert outbox_rows(sql, task_id)[0][2] is not None
    assert queue_depth(stack) == 1


def test_two_publishers_sweeping_at_once_publish_every_row_exactly_once(
    stack: Stack, repo: Store, sql: Sql, make_publisher: Any
) -> None:
    """Both hold a locked batch at the same moment (each waits for the other inside its first
    send), so the second one's lock really had to skip the first one's rows."""
    repo.trigger_many(
        single("fan", "e2e.record", retry=FAST_RETRY), [{"i": i} for i in range(ROWS)]
    )
    publishers = [make_publisher(batch_size=BATCH), make_publisher(batch_size=BATCH)]
    both_hold_a_batch = threading.Barrier(2, timeout=MEET_TIMEOUT_S)
    sent: list[list[int]] = [[], []]
    first_batches: list[set[int]] = [set(), set()]
    failures: list[BaseException] = []

    def sweep_until_empty(n: int) -> None:
        publisher = publishers[n]
        real_send = publisher.send

        def send(batch: Sequence[Dispatch]) -> Collection[int]:
            ids = [d.outbox_id for d in batch]
            if not first_batches[n]:
                first_batches[n] = set(ids)
                both_hold_a_batch.wait()
            sent[n].extend(ids)
            return real_send(batch)

        publisher.send = send  # type: ignore[method-assign]
        try:
            for _ in range(ROWS):  # bounded: each sweep stamps at least one row
                if publisher.sweep() == (0, 0):
                    return
        except BaseException as exc:  # reported on the test's thread
            failures.append(exc)
            both_hold_a_batch.abort()

    threads = [threading.Thread(target=sweep_until_empty, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(MEET_TIMEOUT_S * 3)
    assert not any(t.is_alive() for t in threads), "a publisher never finished its sweeps"
    assert not failures, failures
    assert first_batches[0] and first_batches[1]
    assert not first_batches[0] & first_batches[1], "both locked the same rows"
    assert sorted(sent[0] + sent[1]) == sorted(set(sent[0] + sent[1])), "a row was sent twice"

    stamped = sql.execute("SELECT count(published_at), count(*) FROM outbox").fetchone()
    assert stamped == (ROWS, ROWS)
    wait_for(lambda: queue_depth(stack) == ROWS, timeout=MEET_TIMEOUT_S, what="every message")
    rows = sql.execute("SELECT id, task_run_id, fencing_token FROM outbox").fetchall()
    delivered = drain_queue(stack, limit=2 * ROWS)
    assert sorted(int(str(i)) for i, _ in delivered) == sorted(int(r[0]) for r in rows)
    assert {(d.task_run_id, d.token) for _, d in delivered} == {
        (UUID(str(r[1])), int(r[2])) for r in rows
    }


def drain_queue(stack: Stack, limit: int) -> list[tuple[str | None, Dispatch]]:
    """Take every message off the queue (acking each): (message_id, dispatch), queue order."""
    taken: list[tuple[str | None, Dispatch]] = []
    with broker_channel(stack) as channel:
        for _ in range(limit + 1):
            method, properties, body = channel.basic_get(stack.queue, auto_ack=False)
            if method is None:
                return taken
            taken.append((properties.message_id, messages.decode(body)))
            channel.basic_ack(method.delivery_tag)
    raise AssertionError(f"the queue held more than {limit} messages")


def test_a_queue_of_the_wrong_type_stops_the_publisher_and_the_consumer_with_the_steps(
    stack: Stack,
) -> None:
    with broker_channel(stack) as channel:
        channel.queue_declare(stack.queue, durable=True)  # a classic queue
    config = BrokerConfig(url=(stack.broker_url,), queue=stack.queue)
    publisher, consumer = ConfirmingPublisher(config), Consumer(config)
    for side in (publisher, consumer):
        try:
            with pytest.raises(QueueTypeMismatchError) as refused:
                side.connect()
        finally:
            side.close()
        message = str(refused.value)
        assert "exists with different arguments than the quorum queue" in message
        assert f"delete_queue {stack.queue}" in message
