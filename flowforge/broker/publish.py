"""Publishing dispatch messages with publisher confirms awaited per batch.

A blocking channel in confirm mode pays one network round trip per message. This publisher
drives pika's ``SelectConnection`` itself instead: it sends a whole batch (persistent,
``mandatory=True``), then runs the I/O loop until the broker has confirmed every message of the
batch, so one round trip covers many messages. A message the broker returned as unroutable,
or nacked, is not reported as confirmed, so its outbox row stays pending.

Each message goes to its dispatch's queue (the task's, migration 0014; a row without one to
``broker.queue``), in the band of its priority (``Q``, ``Q.p1`` or ``Q.p5``: migration 0019,
:func:`~flowforge.domain.names.band_queue`); a band is declared, as the same quorum queue the
consumers declare, the first time this connection publishes to it.

Everything here runs in the calling thread; the I/O loop only runs inside :meth:`publish`,
:meth:`connect` and :meth:`idle` — call :meth:`idle` while waiting so heartbeats flow.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop
from pika.channel import Channel
from pika.spec import Basic

from flowforge.broker import messages
from flowforge.broker.tls import connect_error
from flowforge.broker.topology import (
    connection_parameters,
    is_type_mismatch,
    queue_arguments,
    type_mismatch_error,
)
from flowforge.config import BrokerConfig
from flowforge.domain.model import Dispatch
from flowforge.domain.names import band, band_queue
from flowforge.errors import BrokerError, BrokerUnavailableError, QueueTypeMismatchError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
CONFIRM_TIMEOUT_S = 10.0
PERSISTENT = 2
#: Batches in a row whose every message the broker nacked before the channel is given up.
NACK_STREAK_LIMIT = 3
#: How long a task queue the broker refused to declare (another type) is left alone before it
#: is tried again (seconds): its rows stay pending meanwhile, the other queues' go out.
REFUSED_RETRY_S = 60.0


class ConfirmingPublisher:
    """One connection and one confirm-mode channel to the task queues."""

    def __init__(self, config: BrokerConfig) -> None:
        self._config = config
        self._conn: pika.SelectConnection | None = None
        self._channel: Channel | None = None
        self._ready = False
        self._error: BrokerError | None = None
        self._done: Callable[[], bool] = lambda: True
        self._loop: IOLoop | None = None
        self._next_tag = 0
        self._pending: dict[int, int] = {}  # delivery tag → outbox id
        self._confirmed: set[int] = set()
        self._returned: set[int] = set()
        self._nacked = 0  # messages of the current batch the broker nacked
        self._nack_streak = 0  # batches in a row the broker nacked whole
        self._declared: set[str] = set()  # queues declared on the current channel
        self._declaring = config.queue  # the queue a declaration in flight is for
        self._refused: dict[str, float] = {}  # task queue → when the broker refused it

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        """Connect to the first reachable node and declare the queue; raise if none works:
        :class:`BrokerConfigError` if TLS refused any node, else :class:`BrokerUnavailableError`
        (:func:`flowforge.broker.tls.connect_error`)."""
        failures: list[tuple[str, BaseException]] = []
        for params in connection_parameters(self._config):
            try:
                self._connect_to(params)
                return
            except BrokerUnavailableError as exc:
                # pika's own error (kept as the cause) says whether TLS refused the node
                failures.append((f"{params.host}:{params.port}", exc.__cause__ or exc))
                self.close()
        raise connect_error(failures)

    def _connect_to(self, params: pika.URLParameters) -> None:
        self._ready, self._error = False, None
        self._conn = pika.SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
        )
        if not self._run_until(lambda: self._ready, CONNECT_TIMEOUT_S):
            raise BrokerUnavailableError(f"connection timed out after {CONNECT_TIMEOUT_S:g} s")

    def close(self) -> None:
        """Close the connection (best effort) and forget it."""
        conn, self._conn, self._channel = self._conn, None, None
        self._pending.clear()
        if conn is None:
            return
        try:
            if conn.is_open:
                conn.close()
                self._run_loop(conn.ioloop, lambda: conn.is_closed, 2.0)
        except Exception:  # closing a broken connection must never raise
            logger.debug("error while closing the publisher connection", exc_info=True)

    @property
    def is_open(self) -> bool:
        return self._conn is not None and self._conn.is_open and self._ready

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        batch: Sequence[Dispatch],
        timeout_s: float = CONFIRM_TIMEOUT_S,
        more: Callable[[], Sequence[Dispatch]] | None = None,
        wake_fd: int | None = None,
    ) -> set[int]:
        """Publish ``batch``; return the outbox ids the broker confirmed (acked, not returned).

        With ``more`` and ``wake_fd`` (the priority lane): whenever ``wake_fd`` turns readable
        while the confirms are awaited, ``more()`` is called (it must make ``wake_fd`` quiet
        again) and what it returns is published in the same window, its confirms awaited and
        counted in.

        Raises :class:`BrokerUnavailableError` if the connection fails, the confirms do not
        all arrive within ``timeout_s``, or the broker nacked every message of
        :data:`NACK_STREAK_LIMIT` batches in a row; the caller then keeps every row pending.
        The last is a channel given up: a quorum queue's client inside a RabbitMQ channel can
        go on refusing every publish after its queue's leader died (seen for over a minute in
        tests/chaos/test_failover.py) while a fresh channel publishes at once, so the role
        reconnects (``run_role``, with its backoff) instead of sweeping into the refusal.

        A task queue (not ``broker.queue``) that exists with another type is refused by the
        broker, which closes the channel: it is logged with the operator's steps, this call
        raises :class:`BrokerUnavailableError` (the role reconnects), and for
        :data:`REFUSED_RETRY_S` its rows are left pending while the other queues' go out.
        """
        if not self.is_open or self._channel is None:
            raise BrokerUnavailableError("publisher is not connected")
        self._confirmed.clear()
        self._returned.clear()
        self._nacked = 0
        sent = self._send(batch)
        deadline = time.monotonic() + timeout_s
        while self._await_confirms(deadline, wake_fd if more is not None else None):
            assert more is not None
            sent += self._send(more())
        if self._pending:
            raise BrokerUnavailableError(
                f"{len(self._pending)} publisher confirm(s) not received within {timeout_s}s"
            )
        if self._returned:
            logger.warning(
                "%d message(s) returned as unroutable; their outbox rows stay pending",
                len(self._returned),
                extra={"action": "publish_returned"},
            )
        self._judge_nacks(sent)
        return self._confirmed - self._returned

    def _send(self, batch: Sequence[Dispatch]) -> int:
        """Publish each of ``batch`` to its band (declared first if need be); how many went."""
        if not batch:
            return 0
        default = self._config.queue
        targets = [(d, band_queue(d.queue or default, band(d.priority))) for d in batch]
        self._declare_all({(d.queue or default, target) for d, target in targets})
        targets = [(d, target) for d, target in targets if target in self._declared]
        if self._channel is None:
            raise BrokerUnavailableError("publisher is not connected")
        try:
            for dispatch, target in targets:
                self._channel.basic_publish(
                    exchange="",
                    routing_key=target,
                    body=messages.encode(dispatch),
                    properties=pika.BasicProperties(
                        delivery_mode=PERSISTENT,
                        content_type=messages.CONTENT_TYPE,
                        message_id=str(dispatch.outbox_id),
                    ),
                    mandatory=True,
                )
                self._next_tag += 1
                self._pending[self._next_tag] = dispatch.outbox_id
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailableError(f"publish failed: {exc!r}") from exc
        return len(targets)

    def _await_confirms(self, deadline: float, wake_fd: int | None) -> bool:
        """Run the I/O loop until every confirm is in or ``deadline``; True if ``wake_fd``
        turned readable first (confirms still pending)."""
        if wake_fd is None:
            self._run_until(lambda: not self._pending, max(deadline - time.monotonic(), 0.0))
            return False
        woken = self._wait_readable(
            (wake_fd,), max(deadline - time.monotonic(), 0.0), lambda: not self._pending
        )
        return woken and bool(self._pending)

    def refused(self) -> list[str]:
        """The task queues the broker refused within :data:`REFUSED_RETRY_S`: their rows
        are left out of the next batches (see :meth:`publish`)."""
        now = time.monotonic()
        return sorted(q for q, at in self._refused.items() if now - at < REFUSED_RETRY_S)

    def _declare_all(self, targets: set[tuple[str, str]]) -> None:
        """Declare each (task queue, band queue) of ``targets`` whose band this channel has
        not declared yet (one round trip each, once per connection), so a message is never
        returned for a queue no consumer has declared yet. Raises as :meth:`connect` does (a
        queue of another type, an outage); a refusal leaves out the rows of the task queue."""
        now = time.monotonic()
        for queue, target in sorted(t for t in targets if t[1] not in self._declared):
            if now - self._refused.get(queue, -REFUSED_RETRY_S) < REFUSED_RETRY_S:
                continue  # refused lately: its rows wait
            if self._channel is None:
                raise BrokerUnavailableError("publisher is not connected")
            self._declare(self._channel, target)
            try:
                declared = self._run_until(
                    partial(operator.contains, self._declared, target), CONNECT_TIMEOUT_S
                )
            except QueueTypeMismatchError as exc:
                self._refused[queue] = now
                logger.error("%s", exc, extra={"action": "queue_refused"})
                raise BrokerUnavailableError(f"queue {target!r} refused; reconnecting") from exc
            if not declared:
                raise BrokerUnavailableError(f"declaring queue {target!r} timed out")

    def _judge_nacks(self, sent: int) -> None:
        """Count a batch the broker nacked whole; give the channel up at the limit."""
        if not sent or self._nacked < sent:
            self._nack_streak = 0
            return
        self._nack_streak += 1
        if self._nack_streak >= NACK_STREAK_LIMIT:
            self._nack_streak = 0
            self._ready = False  # is_open is False: nothing publishes on it again
            raise BrokerUnavailableError(
                f"the broker nacked every message of {NACK_STREAK_LIMIT} batches in a row:"
                " reconnecting on a fresh channel"
            )

    def idle(self, timeout_s: float, wake_fds: Sequence[int] = ()) -> None:
        """Run the I/O loop (heartbeats) for ``timeout_s`` or until one of ``wake_fds`` is
        readable (a NOTIFY, a stop: :class:`~flowforge.roles.stopping.Stop`)."""
        if not wake_fds:
            self._run_until(lambda: False, timeout_s, timeout_is_failure=False)
        else:
            self._wait_readable(wake_fds, timeout_s, lambda: False)

    def _wait_readable(
        self, fds: Sequence[int], timeout_s: float, done: Callable[[], bool]
    ) -> bool:
        """Run the I/O loop until ``done()``, one of ``fds`` is readable or ``timeout_s``; True
        if one turned readable."""
        if self._conn is None:
            raise BrokerUnavailableError("publisher is not connected")
        woken = [False]
        ioloop = self._conn.ioloop

        def wake(_fd: int, _events: int) -> None:
            woken[0] = True
            ioloop.stop()

        for fd in fds:
            ioloop.add_handler(fd, wake, IOLoop.READ)
        try:
            self._run_until(lambda: woken[0] or done(), timeout_s, timeout_is_failure=False)
        finally:
            if self._conn is not None:
                for fd in fds:
                    self._conn.ioloop.remove_handler(fd)
        return woken[0]

    # ------------------------------------------------------------------ the I/O loop

    def _run_until(
        self, done: Callable[[], bool], timeout_s: float, timeout_is_failure: bool = True
    ) -> bool:
        """Run the I/O loop until ``done()`` or ``timeout_s``; raise a recorded error."""
        if self._conn is None:
            raise BrokerUnavailableError("publisher is not connected")
        finished = self._run_loop(
            self._conn.ioloop, lambda: done() or self._error is not None, timeout_s
        )
        if self._error is not None:
            error, self._error = self._error, None
            self._ready = False
            raise error
        return finished or not timeout_is_failure

    def _run_loop(self, ioloop: IOLoop, done: Callable[[], bool], timeout_s: float) -> bool:
        if done():
            return True
        timed_out = [False]

        def on_timeout() -> None:
            timed_out[0] = True
            ioloop.stop()

        self._done, self._loop = done, ioloop
        timer = ioloop.call_later(timeout_s, on_timeout)
        try:
            ioloop.start()
        finally:
            ioloop.remove_timeout(timer)
            self._done, self._loop = (lambda: True), None
        return done()

    def _check_done(self) -> None:
        """Called at the end of every callback: stop the running loop once its goal is met."""
        if self._loop is not None and self._done():
            self._loop.stop()

    # ------------------------------------------------------------------ pika callbacks

    def _on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._on_channel_open)

    def _on_open_error(self, _conn: Any, error: BaseException) -> None:
        self._error = BrokerUnavailableError(f"cannot connect: {error!r}")
        self._error.__cause__ = error  # connect() classifies it (a TLS refusal or an outage)
        self._check_done()

    def _on_closed(self, _conn: Any, reason: BaseException) -> None:
        self._ready = False
        if self._error is None:
            self._error = BrokerUnavailableError(f"connection closed: {reason!r}")
        self._check_done()

    def _on_channel_open(self, channel: Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(
            self._on_confirm, callback=lambda _frame: self._declare(channel, self._config.queue)
        )

    def _declare(self, channel: Channel, queue: str) -> None:
        self._declaring = queue
        channel.queue_declare(
            queue,
            durable=True,
            arguments=queue_arguments(self._config),
            callback=lambda _frame: self._on_declared(queue),
        )

    def _on_declared(self, queue: str) -> None:
        if not self._ready:  # the channel's first declaration: broker.queue's
            self._declared.clear()
            self._ready = True
            self._next_tag = 0
        self._declared.add(queue)
        self._check_done()

    def _on_channel_closed(self, _channel: Channel, reason: BaseException) -> None:
        self._ready = False
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker) and is_type_mismatch(
            reason.reply_code, reason.reply_text
        ):
            self._error = type_mismatch_error(self._declaring, reason.reply_text)
        elif self._error is None:
            self._error = BrokerUnavailableError(f"channel closed: {reason!r}")
        self._check_done()

    def _on_return(self, _channel: Channel, _method: Any, properties: Any, _body: bytes) -> None:
        if properties.message_id is not None:
            self._returned.add(int(properties.message_id))

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, Basic.Ack)
        tags = (
            [t for t in self._pending if t <= method.delivery_tag]
            if method.multiple
            else [method.delivery_tag]
        )
        for tag in tags:
            outbox_id = self._pending.pop(tag, None)
            if outbox_id is not None and acked:
                self._confirmed.add(outbox_id)
            elif outbox_id is not None:
                self._nacked += 1
        self._check_done()
