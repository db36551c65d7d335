"""Consuming dispatch messages with manual acknowledgement (pika ``BlockingConnection``).

A task queue is three quorum queues, one per priority band (``Q``, ``Q.p1``, ``Q.p5``:
:data:`~flowforge.domain.names.BANDS`), because a quorum queue has no priorities. The consumer
has one channel per band, each with its own consumer and its own prefetch, so a full window of
low-priority deliveries never stops the broker from pushing a high-priority one: it waits in
this worker's buffer and the next take returns it first (docs/flow-control.md "Priorities").

The worker owns the connection's thread: it calls :meth:`Consumer.take` to wait for a batch of
up to ``limit`` deliveries, highest band first (each band's prefetch is that limit, so the
broker pushes no more of a band until its part of the batch is acked), :meth:`Consumer.ack`
once the batch is done (per band: the deliveries of a band are taken in order),
:meth:`Consumer.take_above` between two tasks of a batch (a higher band's delivery that came in
meanwhile runs before the rest of it), and :meth:`Consumer.pump` while a handler runs in
another thread, so heartbeats keep flowing however long the handler takes. A worker held up by
a slow handler calls :meth:`Consumer.hand_back` *before* acking: the consumer is cancelled and
anything it holds unclaimed goes back to the queue, so a busy (or frozen) worker never sits on
messages other workers could run.

RabbitMQ cancels a consumer by itself when its queue is deleted or becomes unavailable, and
says so with a ``basic.cancel``. The consumer then subscribes again on the next
:meth:`Consumer.take`; should the queue still be missing, that fails as
:class:`BrokerUnavailableError` and the role reconnects, which declares the queue again.
Without this a worker would wait forever on a consumer that no longer exists.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
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
from flowforge.domain.names import BANDS, band_queue
from flowforge.errors import BrokerUnavailableError

logger = logging.getLogger(__name__)

#: The consumer priority (RabbitMQ's ``x-priority``) of a reserved worker's consumers; every
#: other consumer has the default, 0.
RESERVED_PRIORITY = 10


@dataclass(frozen=True)
class Delivery:
    tag: int
    body: bytes
    redelivered: bool
    band: int = 0  # the index in BANDS of the band (channel) it came on: tags are per channel


class Deliveries(Protocol):
    """What a worker needs of its broker: the seam :class:`Consumer` implements over pika
    and tests replace with a stub (``tests/stubs.py``). Every method but :meth:`close` raises
    :class:`BrokerUnavailableError` when the connection is lost; see :class:`Consumer` for the
    contract of each."""

    def connect(self) -> None: ...

    def take(self, limit: int, timeout_s: float) -> list[Delivery]: ...

    def take_above(self, band: int, limit: int) -> list[Delivery]: ...

    def waiting(self) -> bool: ...

    def ack(self, deliveries: Sequence[Delivery]) -> None: ...

    def hand_back(self) -> int: ...

    def resume(self) -> None: ...

    def pump(self, time_limit_s: float = 0.0) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class Consumer:
    """A connection and, per priority band of the task queue, a channel with its prefetch and
    a (pausable) consumer."""

    def __init__(self, config: BrokerConfig, min_band: int = 0) -> None:
        """``min_band``: the index in ``BANDS`` of the lowest band consumed. Above 0 this is a
        reserved worker's consumer (docs/flow-control.md "Reserved workers"): it consumes only
        those bands, with a consumer priority, so the broker hands their messages to it first
        while it has room and to the other workers' consumers only when it has none."""
        self._config = config
        self._bands = range(min_band, len(BANDS))
        self._consume_args = {"x-priority": RESERVED_PRIORITY} if min_band else None
        self._queues = [band_queue(config.queue, i) for i in range(len(BANDS))]
        self._conn: pika.BlockingConnection | None = None
        self._channels: list[BlockingChannel] = []
        self._consumer_tags: list[str | None] = [None] * len(BANDS)
        self._prefetch = config.prefetch
        self._buffers: list[collections.deque[Delivery]] = [collections.deque() for _ in BANDS]

    def connect(self) -> None:
        """Connect to the first node that answers; per band, open a channel with the prefetch
        and declare the band's quorum queue.

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
        queue = self._queues[0]
        try:
            for index, queue in enumerate(self._queues):
                channel = self._conn.channel()
                channel.basic_qos(prefetch_count=self._config.prefetch)
                channel.add_on_cancel_callback(partial(self._on_cancelled_by_broker, index))
                channel.queue_declare(queue, durable=True, arguments=queue_arguments(self._config))
                self._channels.append(channel)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self.close()
            if is_type_mismatch(exc.reply_code, exc.reply_text):
                raise type_mismatch_error(queue, exc.reply_text) from exc
            raise BrokerUnavailableError(f"channel closed by broker: {exc!r}") from exc
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            raise BrokerUnavailableError(f"cannot open a channel: {exc!r}") from exc

    def close(self) -> None:
        """Close the connection; unacked deliveries go back to their queues."""
        conn, self._conn, self._channels = self._conn, None, []
        self._consumer_tags = [None] * len(BANDS)
        self._prefetch = self._config.prefetch
        for buffer in self._buffers:
            buffer.clear()
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # a broken connection must not fail the close
                logger.debug("error while closing the consumer connection", exc_info=True)

    def resume(self) -> None:
        """Start (or restart) receiving deliveries, on every band: the highest first, so that
        what waits in it is here before a lower band's first delivery can fill the take."""
        for index in reversed(self._bands):
            if self._consumer_tags[index] is None:
                on_message = partial(self._on_message, index)
                self._consumer_tags[index] = self._call(
                    index,
                    lambda ch, q=self._queues[index], cb=on_message: ch.basic_consume(
                        q, cb, auto_ack=False, arguments=self._consume_args
                    ),
                )

    def pause(self) -> None:
        """Stop receiving deliveries; those already received stay ours to ack."""
        for index, tag in enumerate(self._consumer_tags):
            if tag is not None:
                self._consumer_tags[index] = None
                self._call(index, lambda ch, tag=tag: ch.basic_cancel(tag))

    def take(self, limit: int, timeout_s: float) -> list[Delivery]:
        """Up to ``limit`` deliveries, highest band first, waiting up to ``timeout_s`` for the
        first one.

        Each band's consumer runs with a prefetch of ``limit`` (restarted when the limit
        changes), so until they are acked no further message of that band is pushed here.
        Heartbeats are served while waiting; the connection is always read once, so a
        high-priority delivery that came in while lower ones waited here is taken first.
        """
        if any(self._consumer_tags[i] is None for i in self._bands) or self._prefetch != limit:
            self.pause()
            for index in self._bands:
                self._call(index, lambda ch: ch.basic_qos(prefetch_count=limit))
            self._prefetch = limit
            self.resume()
        self.pump(0.0 if any(self._buffers) else timeout_s)
        return _highest_first(self._buffers, limit)

    def take_above(self, band: int, limit: int) -> list[Delivery]:
        """Up to ``limit`` deliveries of the bands above ``band`` (an index in ``BANDS``),
        highest first, without waiting: the connection is read once, so one pushed while a
        batch runs is seen. A batch that takes them acks them with its own (see :meth:`ack`:
        still exact, as each band's deliveries are taken in the order they came)."""
        self.pump(0.0)
        return _highest_first(self._buffers[band + 1 :], limit)

    def waiting(self) -> bool:
        """Serve the connection without waiting (heartbeats; deliveries into the buffers), then
        whether a delivery waits here — or may wait in the queue unseen: True while a band
        consumed is not being consumed (paused: nothing of it is pushed here)."""
        if any(self._consumer_tags[i] is None for i in self._bands):
            return True
        self.pump(0.0)
        return any(self._buffers[i] for i in self._bands)

    def hand_back(self) -> int:
        """Stop consuming and requeue every delivery received but not taken; return how many.

        Deliveries already taken stay ours to ack.
        """
        self.pause()
        requeued = 0
        for index, buffer in enumerate(self._buffers):
            tags = [d.tag for d in buffer]
            buffer.clear()
            for tag in tags:
                self._call(index, lambda ch, tag=tag: ch.basic_nack(tag, requeue=True))
            requeued += len(tags)
        return requeued

    def pump(self, time_limit_s: float = 0.0) -> None:
        """Serve the connection (heartbeats, deliveries into the buffers) for ``time_limit_s``."""
        if self._conn is None:
            raise BrokerUnavailableError("consumer is not connected")
        try:
            self._conn.process_data_events(time_limit=time_limit_s)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise BrokerUnavailableError(f"broker connection lost: {exc!r}") from exc

    def wake(self) -> None:
        """End a :meth:`take` (or :meth:`pump`) waiting now, or the next one, at once: a stop
        (:class:`~flowforge.roles.stopping.Stop`). The one method callable from any thread
        (pika's ``add_callback_threadsafe``); nothing when not connected."""
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.add_callback_threadsafe(_nothing)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge ``deliveries`` (taken): one multiple ack per band, through the band's
        last. Exact: a band's deliveries are taken in the order they came, and a batch is
        acked before the next is taken, so every delivery of the band up to that tag is one
        of these (or acked before) — never one still waiting in the buffer.

        Failure raises: an ack that failed is never a success.
        """
        last: dict[int, int] = {}
        for delivery in deliveries:
            last[delivery.band] = max(delivery.tag, last.get(delivery.band, 0))
        for index, tag in sorted(last.items()):
            self._call(index, lambda ch, tag=tag: ch.basic_ack(tag, multiple=True))

    @staticmethod
    def _consume(queue: str, on_message: Any, channel: BlockingChannel) -> str:
        return str(channel.basic_consume(queue, on_message, auto_ack=False))

    def _call(self, index: int, action: Any) -> Any:
        if len(self._channels) <= index:
            raise BrokerUnavailableError("consumer is not connected")
        try:
            return action(self._channels[index])
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise BrokerUnavailableError(f"broker call failed: {exc!r}") from exc

    def _on_cancelled_by_broker(self, index: int, method_frame: Any) -> None:
        """The broker ended a band's consumer (queue deleted or unavailable): subscribe again
        on the next take. Deliveries already received stay ours to ack. A cancel for a tag we
        already cancelled ourselves (the two crossed) needs nothing."""
        if method_frame.method.consumer_tag != self._consumer_tags[index]:
            return
        self._consumer_tags[index] = None
        logger.warning(
            "the broker cancelled this consumer of %s; subscribing again",
            self._queues[index],
            extra={"action": "consumer_cancelled"},
        )

    def _on_message(
        self, index: int, _channel: Any, method: Any, _properties: Any, body: bytes
    ) -> None:
        self._buffers[index].append(
            Delivery(method.delivery_tag, body, bool(method.redelivered), index)
        )


def _highest_first(buffers: Sequence[collections.deque[Delivery]], limit: int) -> list[Delivery]:
    """Up to ``limit`` deliveries popped from ``buffers`` (bands, lowest first), the highest
    band's first and each band's in the order they came."""
    taken: list[Delivery] = []
    for buffer in reversed(buffers):
        while buffer and len(taken) < limit:
            taken.append(buffer.popleft())
    return taken


def _nothing() -> None:
    """What a wake asks pika to call: its arrival alone ends the wait."""
