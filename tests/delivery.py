"""Helpers shared by the tests that drive real role processes over a real broker
(tests/integration/test_roles_delivery.py, test_worker_batches.py): the stack's queue seen from
the broker, raw publishes, executions and counters read from the database."""

from __future__ import annotations

import signal
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from uuid import UUID

import pika
import pika.exceptions
import psycopg
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from flowforge.broker import messages
from flowforge.domain.model import Dispatch
from flowforge.roles.publisher import Publisher
from supervisor import exitcodes
from tests.e2e import RoleProcess, Stack
from tests.store import Store

Sql = psycopg.Connection[tuple[Any, ...]]

#: How long an emptied queue must stay empty once its consumer has gone (proves the ack).
STAYS_EMPTY_S = 1.0
EXIT_TIMEOUT_S = 15.0
BROKER_POLL_S = 0.1
NOT_FOUND = 404


def executions(sql: Sql, task_id: UUID | None = None) -> list[tuple[int, int]]:
    """Recorded handler executions as (attempt, pid), oldest first (of one task, or all)."""
    found = sql.execute(
        "SELECT attempt, pid FROM test_executions"
        " WHERE %(id)s::uuid IS NULL OR task_run_id = %(id)s::uuid ORDER BY id",
        {"id": task_id},
    ).fetchall()
    return [(int(a), int(p)) for a, p in found]


def worker_pid(attempt_worker: str | None) -> int:
    """The pid in an attempt's worker id (``host/pid``)."""
    assert attempt_worker is not None
    return int(attempt_worker.rsplit("/", 1)[1])


def stale_completions(repo: Store) -> int:
    return repo.counters().get("stale_completions", 0)


def exit_code(process: RoleProcess, timeout: float = EXIT_TIMEOUT_S) -> int:
    return process.wait(timeout)


def stop_cleanly(process: RoleProcess) -> None:
    """SIGTERM the process; it must exit 0 (its log is shown otherwise)."""
    process.signal(signal.SIGTERM)
    code = exit_code(process)
    assert code == exitcodes.CLEAN, f"{process.role} exited {code}:\n{process.log()}"


@contextmanager
def broker_channel(stack: Stack) -> Iterator[BlockingChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(stack.broker_url))
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            conn.close()


def queue_depth(stack: Stack) -> int:
    """Messages ready in the stack's queue (unacked ones are not counted); -1 while the queue
    does not exist."""
    declared = _declared(stack)
    return -1 if declared is None else int(declared.message_count)


def consumer_count(stack: Stack) -> int:
    """Consumers subscribed to the stack's queue; -1 while the queue does not exist."""
    declared = _declared(stack)
    return -1 if declared is None else int(declared.consumer_count)


def _declared(stack: Stack) -> Any | None:
    """The broker's answer to a passive declare of the stack's queue; None if it is missing."""
    with broker_channel(stack) as channel:
        try:
            return channel.queue_declare(stack.queue, passive=True).method
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == NOT_FOUND:
                return None
            raise


def stays_empty(stack: Stack, seconds: float = STAYS_EMPTY_S) -> bool:
    """True if the queue holds no message for ``seconds`` (an unacked one would come back)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if queue_depth(stack):
            return False
        time.sleep(BROKER_POLL_S)
    return True


def publish_raw(stack: Stack, dispatch: Dispatch) -> None:
    """Put one dispatch message on the stack's queue, as the publisher would (confirmed)."""
    with broker_channel(stack) as channel:
        channel.confirm_delivery()
        channel.basic_publish(
            exchange="",
            routing_key=stack.queue,
            body=messages.encode(dispatch),
            properties=pika.BasicProperties(
                delivery_mode=2,
                content_type=messages.CONTENT_TYPE,
                message_id=str(dispatch.outbox_id),
            ),
            mandatory=True,
        )


def outbox_rows(sql: Sql, task_id: UUID) -> list[tuple[int, int, datetime | None]]:
    """(outbox id, token, published_at) of one task run, oldest first."""
    return [
        (int(i), int(t), p)
        for i, t, p in sql.execute(
            "SELECT id, fencing_token, published_at FROM outbox WHERE task_run_id = %s ORDER BY id",
            (task_id,),
        ).fetchall()
    ]


def publish_twice_losing_the_first_confirm(
    stack: Stack, sql: Sql, publisher: Publisher, task_id: UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sweep the one outbox row of ``task_id`` while its publisher confirm is lost on the way to
    the stamping code, then sweep again: the row stays pending after the first sweep and is
    stamped by the second, so the queue holds two copies of one generation (at least once)."""
    [(outbox_id, _, _)] = outbox_rows(sql, task_id)
    real_send = publisher.send
    confirmed_by_broker: list[Collection[int]] = []

    def lose_the_confirms(batch: Sequence[Dispatch]) -> Collection[int]:
        confirmed_by_broker.append(real_send(batch))
        return set()  # the confirm never reaches the stamping code

    monkeypatch.setattr(publisher, "send", lose_the_confirms)
    assert publisher.sweep() == (1, 0)
    assert confirmed_by_broker == [{outbox_id}], "the broker did not really get it"
    assert outbox_rows(sql, task_id)[0][2] is None, "stamped without a confirm"
    assert queue_depth(stack) == 1

    monkeypatch.setattr(publisher, "send", real_send)
    assert publisher.sweep() == (1, 1)
    assert outbox_rows(sql, task_id)[0][2] is not None
    assert publisher.sweep() == (0, 0)
    assert queue_depth(stack) == 2  # at least once: both copies are on the queue
    assert len(outbox_rows(sql, task_id)) == 1  # one generation: a worker claims it once
