"""Consuming dispatch messages with manual acknowledgement (pika ``BlockingConnection``).

The worker owns the connection's thread: it calls :meth:`Consumer.take` to wait for a batch of
up to ``limit`` deliveries (the consumer's prefetch is that limit, so the broker pushes nothing
more until the batch is acked), :meth:`Consumer.ack_through` once the batch is done, and
:meth:`Consumer.pump` while a handler runs in another thread, so heartbeats keep flowing however
long the handler takes. A worker held up by a slow handler calls :meth:`Consumer.hand_back`
*before* acking: the consumer is cancelled and anything it holds unclaimed goes back to the
queue, so a busy (or frozen) worker never sits on messages other workers could run.

RabbitMQ cancels a consumer by itself when its queue is deleted or becomes unavailable, and
says so with a ``basic.cancel``. The consumer then subscribes again on the next
:meth:`Consumer.take`; should the queue still be missing, that fails as
:class:`BrokerUnavailableError` and the role reconnects, which declares the queue again.
Without this a worker would wait forever on a consumer that no longer exists.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from flowforge.broker.tls import connect_error
from flowforge.broker.topology import (
    connection_parameters,
    is_type_mismatch,
    queue_arguments,
    type_mismatch_error,
)
from flowforge.config import BrokerConfig
from flowforge.errors import BrokerUnavailableError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivery:
    tag: int
    body: bytes
    redelivered: bool


class Deliveries(Protocol):
    """What a worker needs of its broker: the seam :class:`Consumer` implements over pika
    and tests replace with a stub (``tests/stubs.py``). Every method but :meth:`close` raises
    :class:`BrokerUnavailableError` when the connection is lost; see :class:`Consumer` for the
    contract of each."""

    def connect(self) -> None: ...

    def take(self, limit: int, timeout_s: float) -> list[Delivery]: ...

    def ack_through(self, tag: int) -> None: ...

    def hand_back(self) -> int: ...

    def pump(self, time_limit_s: float = 0.0) -> None: ...

    def close(self) -> None: ...


class Consumer:
    """A connection, a channel with ``prefetch`` and a (pausable) consumer on the task queue."""

    def __init__(self, config: BrokerConfig) -> None:
        self._config = config
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._consumer_tag: str | None = None
        self._prefetch = config.prefetch
        self._buffer: collections.deque[Delivery] = collections.deque()

    def connect(self) -> None:
        """Connect to the first node that answers, set the prefetch, declare the quorum queue.

        Reaching no node raises :class:`BrokerConfigError` if TLS refused any of them, else
        :class:`BrokerUnavailableError` (:func:`flowforge.broker.tls.connect_error`).
        """
        failures: list[tuple[str, BaseException]] = []
        for params in connection_parameters(self._config):
            try:  # one node at a time: pika would report only the last node's failure
                self._conn = pika.BlockingConnection(params)
                break
            except (pika.exceptions.AMQPError, OSError) as exc:
                failures.append((f"{params.host}:{params.port}", exc))
        else:
            raise connect_error(failures) from failures[-1][1]
        try:
            self._channel = self._conn.channel()
            self._channel.basic_qos(prefetch_count=self._config.prefetch)
            self._channel.add_on_cancel_callback(self._on_cancelled_by_broker)
            self._channel.queue_declare(
                self._config.queue, durable=True, arguments=queue_arguments(self._config)
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            self.close()
            if is_type_mismatch(exc.reply_code, exc.reply_text):
                raise type_mismatch_error(self._config.queue, exc.reply_text) from exc
            raise BrokerUnavailableError(f"channel closed by broker: {exc!r}") from exc
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            raise BrokerUnavailableError(f"cannot open a channel: {exc!r}") from exc

    def close(self) -> None:
        """Close the connection; unacked deliveries go back to the queue."""
        conn, self._conn, self._channel, self._consumer_tag = self._conn, None, None, None
        self._prefetch = self._config.prefetch
        self._buffer.clear()
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # a broken connection must not fail the close
                logger.debug("error while closing the consumer connection", exc_info=True)

    def resume(self) -> None:
        """Start (or restart) receiving deliveries."""
        if self._consumer_tag is None:
            self._consumer_tag = self._call(
                lambda ch: ch.basic_consume(self._config.queue, self._on_message, auto_ack=False)
            )

    def pause(self) -> None:
        """Stop receiving deliveries; those already received stay ours to ack."""
        if self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            self._call(lambda ch: ch.basic_cancel(tag))

    def take(self, limit: int, timeout_s: float) -> list[Delivery]:
        """Up to ``limit`` deliveries, waiting up to ``timeout_s`` for the first one.

        The consumer runs with a prefetch of ``limit`` (it is restarted when the limit
        changes), so until they are acked no further message is pushed here. Heartbeats are
        served while waiting.
        """
        if self._consumer_tag is None or self._prefetch != limit:
            self.pause()
            self._call(lambda ch: ch.basic_qos(prefetch_count=limit))
            self._prefetch = limit
            self.resume()
        if not self._buffer:
            self.pump(timeout_s)
        taken: list[Delivery] = []
        while self._buffer and len(taken) < limit:
            taken.append(self._buffer.popleft())
        return taken

    def hand_back(self) -> int:
        """Stop consuming and requeue every delivery received but not taken; return how many.

        Deliveries already taken stay ours to ack.
        """
        self.pause()
        if not self._buffer:
            return 0
        tags = [d.tag for d in self._buffer]
        self._buffer.clear()
        for tag in tags:
            self._call(lambda ch, tag=tag: ch.basic_nack(tag, multiple=False, requeue=True))
        return len(tags)

    def pump(self, time_limit_s: float = 0.0) -> None:
        """Serve the connection (heartbeats, deliveries into the buffer) for ``time_limit_s``."""
        if self._conn is None:
            raise BrokerUnavailableError("consumer is not connected")
        try:
            self._conn.process_data_events(time_limit=time_limit_s)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise BrokerUnavailableError(f"broker connection lost: {exc!r}") from exc

    def ack_through(self, tag: int) -> None:
        """Acknowledge every delivery taken up to ``tag`` (deliveries are taken in order).

        Failure raises: an ack that failed is never a success.
        """
        self._call(lambda ch: ch.basic_ack(tag, multiple=True))

    def _call(self, action: Any) -> Any:
        if self._channel is None:
            raise BrokerUnavailableError("consumer is not connected")
        try:
            return action(self._channel)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise BrokerUnavailableError(f"broker call failed: {exc!r}") from exc

    def _on_cancelled_by_broker(self, method_frame: Any) -> None:
        """The broker ended our consumer (queue deleted or unavailable): subscribe again on
        the next take. Deliveries already received stay ours to ack. A cancel for a tag we
        already cancelled ourselves (the two crossed) needs nothing."""
        if method_frame.method.consumer_tag != self._consumer_tag:
            return
        self._consumer_tag = None
        logger.warning(
            "the broker cancelled this consumer of %s; subscribing again",
            self._config.queue,
            extra={"action": "consumer_cancelled"},
        )

    def _on_message(self, _channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        self._buffer.append(Delivery(method.delivery_tag, body, bool(method.redelivered)))
