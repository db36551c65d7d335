"""The worker's consumer side: the window, taking deliveries, the batch's ack, and the broker
connection's turns while handlers run.

The consumer's prefetch *is* the window: until a batch is acked the broker pushes nothing more
to this worker. The window starts at 1, doubles after every cheap batch up to
``broker.prefetch``, and falls back to 1 after a slow sync handler. A batch is cheap while its
sync handlers took ``worker.fast_handler_ms`` in all and its payload (:attr:`Claim.payload_bytes
<flowforge.domain.model.Claim.payload_bytes>` and the results) came to :data:`BATCH_BYTES`; one
that cost more than twice either halves the window, one in between keeps it. A batch is judged
by what it cost per task, as if it had filled the window: one that came short (a queue nearly
empty) says nothing about a full one. So the prefetch only caps a batch: what a batch holds up
(the tasks queued behind its handlers, which no other worker can take meanwhile) and what it
holds in memory (every claim's input, every result and captured output until the finish
commits) stay near those budgets whatever the prefetch. A worker with
``async def`` handlers lets it grow to ``worker.async_concurrency`` if that is larger, and one
with async handlers only opens it that wide at once (:meth:`Intake.widen`). After a batch held
up by a slow sync handler the worker consumes only while it takes: what else came with the
take is handed back at once, so a delivery (an urgent one above all) never waits in a worker
whose handlers are slow.

A broker call that fails once the batch's claims committed does not stop the batch (the
leases own its tasks): the failure is kept in :attr:`Intake.broken` and raised by
:meth:`Intake.settle` when the batch is done, so the role reconnects; meanwhile nothing more
is asked of the broken connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple
from uuid import UUID

from flowforge.broker.consume import Deliveries, Delivery
from flowforge.broker.messages import MessageError, decode
from flowforge.errors import BrokerUnavailableError
from flowforge.roles.hooks import WORKER_LOGGER

logger = logging.getLogger(WORKER_LOGGER)

#: While a handler runs, serve the broker connection at least this often (seconds); as long
#: the worker may work on its own continuations before the broker gets its turn.
PUMP_INTERVAL_S = 1.0
#: The broker's turn counts as served without a take (:meth:`Intake.owed`) only once the last
#: ack is this old (seconds): until the ack the prefetch window was full, and the deliveries
#: it lets in take a round trip to come. A delivery still missed waits for the next turn.
ACK_SETTLE_S = 0.2
#: A batch's payload above which its window stops growing, and above twice which it is halved
#: (bytes): a worker holds a whole batch's inputs, items, inline upstream results, results and
#: captured output at once, and inputs may be up to 16 MiB each (domain/values.py), so a bound
#: by count alone (``broker.prefetch``) would let a batch of large values take gigabytes.
BATCH_BYTES = 2 * 1024 * 1024


class BatchCost(NamedTuple):
    """What a batch of ``tasks`` tasks cost: its sync handlers' time in all (seconds) and
    its payload (bytes; :meth:`Batch.cost <flowforge.roles.batch.Batch.cost>`)."""

    busy_s: float = 0.0
    payload_bytes: int = 0
    tasks: int = 0


class Intake:
    """Deliveries in, acks out, over a :class:`~flowforge.broker.consume.Deliveries`."""

    def __init__(self, broker: Deliveries, prefetch: int, fast_s: float) -> None:
        """``fast_s``: ``worker.fast_handler_ms`` in seconds, the time a cheap batch's sync
        handlers may take in all (see the module docstring)."""
        self._broker = broker
        self._prefetch = prefetch
        self._fast_s = fast_s
        self.window = 1
        self.broken: BrokerUnavailableError | None = None
        self._took_at = 0.0
        self._acked_at = 0.0  # the last ack (monotonic; see owed())
        self._slow = False  # the last batch had a slow handler: hold nothing while running

    def connect(self) -> None:
        self.broken = None
        self._broker.connect()

    def close(self) -> None:
        """Close the connection; the broker requeues every delivery not acked."""
        self._broker.close()

    def widen(self, cap: int, at_once: bool) -> None:
        """A worker with async handlers: a batch of them should fill ``cap``
        (``worker.async_concurrency``), so the window may grow to it if that is above
        ``broker.prefetch``. ``at_once`` (async handlers only, which none holds up): the window
        is ``cap`` from now on, never more (a claim beyond the free slots would only wait), and
        less only after batches whose payload was large (:meth:`settle`)."""
        self._prefetch = cap if at_once else max(self._prefetch, cap)
        if at_once:
            self.window = cap

    def limit(self) -> int:
        return min(self.window, self._prefetch)

    def due(self) -> bool:
        """True when the broker has waited its turn (:data:`PUMP_INTERVAL_S` since a take)."""
        return time.monotonic() - self._took_at > PUMP_INTERVAL_S

    def owed(self) -> bool:
        """True if the broker is due its turn (:meth:`due`) and may have deliveries for this
        worker: they are taken next, and the worker's continuation goes out as a message,
        queued behind them.

        A turn due is served here at once, without waiting (heartbeats too): when nothing waits
        here — no delivery buffered, every band consumed, and the window open for at least
        :data:`ACK_SETTLE_S` (no ack since then: the broker pushed whatever waited) — the
        broker has had its turn, and the continuation stays with this worker instead of making
        a round trip through the publisher and the broker to land here again
        (docs/performance.md "The worker's side of a hop"). A broker call that fails is kept
        in :attr:`broken` (as for :meth:`serve`)."""
        if not self.due():
            return False
        if self.broken is not None or self._slow:
            return True
        if time.monotonic() - self._acked_at < ACK_SETTLE_S:
            return True  # the window was full until then: what waits may not be here yet
        try:
            if self._broker.waiting():
                return True
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while serving its turn: %s", exc)
            self.broken = exc
            return True
        self._took_at = time.monotonic()
        return False

    def take(self, limit: int, timeout_s: float) -> tuple[list[tuple[UUID, int]], list[Delivery]]:
        """Up to ``limit`` deliveries (waiting up to ``timeout_s`` for the first), highest
        priority band first, as the (task run, token) pairs they name, and the deliveries
        themselves, to ack (empty: nothing came). An undecodable message is logged and dropped:
        it is acked with its batch."""
        deliveries = self._broker.take(limit, timeout_s)
        self._took_at = time.monotonic()
        if self._slow and deliveries:
            # After a slow batch, hold nothing while this one runs: a delivery that came with
            # the take (another band's, up to one each) would wait for handlers that may be
            # slow again, and be handed back at the slow moment to a worker in the same state.
            # Consuming only while taking, a worker gets it when it can run it.
            self.hand_back()
        return _named(deliveries), deliveries

    def take_above(self, band: int, limit: int) -> tuple[list[tuple[UUID, int]], list[Delivery]]:
        """As :meth:`take`, but only deliveries of a band above ``band`` already here, without
        waiting (a batch running looks for them between two tasks). Nothing once the connection
        broke; a failure now breaks it (kept in :attr:`broken`, as for :meth:`serve`)."""
        if self.broken is not None:
            return [], []
        try:
            deliveries = self._broker.take_above(band, limit)
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while a batch runs: %s", exc)
            self.broken = exc
            return [], []
        return _named(deliveries), deliveries

    def ack(self, taken: Sequence[Delivery]) -> None:
        """Ack the deliveries ``taken`` (the claims committed): one multiple ack per band."""
        if self.broken is not None or not taken:
            return
        try:
            self._acked_at = time.monotonic()
            self._broker.ack(taken)
        except BrokerUnavailableError as exc:
            # The claims committed: the leases own the tasks and the handlers still run. The
            # broker will redeliver the messages, and those deliveries are acked without running.
            logger.warning("ack after claim failed: %s", exc, extra={"action": "ack_failed"})
            self.broken = exc

    def resume(self) -> None:
        """Consume again after :meth:`hand_back` (a batch rolling on once a slot is free)."""
        if self.broken is not None:
            return
        try:
            self._broker.resume()
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while resuming: %s", exc)
            self.broken = exc

    def hand_back(self) -> None:
        """Stop consuming and requeue what was received but not taken (a slow handler)."""
        if self.broken is not None:
            return
        try:
            requeued = self._broker.hand_back()
            if requeued:
                logger.debug("requeued %d unclaimed deliveries", requeued)
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while handing back: %s", exc)
            self.broken = exc

    def wake(self) -> None:
        """End a :meth:`take`'s wait at once (a stop); callable from any thread."""
        self._broker.wake()

    def serve(self, seconds: float = 0.0) -> None:
        """Serve the connection (heartbeats) for ``seconds``; just wait if it is broken."""
        if self.broken is not None:
            time.sleep(seconds)
            return
        try:
            self._broker.pump(seconds)
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while a handler runs: %s", exc)
            self.broken = exc

    def settle(self, held_up: bool, cost: BatchCost) -> None:
        """A batch is done: reset the window if a slow sync handler held the batch up
        (:attr:`~flowforge.roles.batch.Batch.held_up`), else double, keep or halve it by what
        a full window of such tasks would cost (``cost``; module docstring; a batch of no task
        counts as cheap); raise a failure the batch outlived."""
        budgets = max(cost.busy_s / self._fast_s, cost.payload_bytes / BATCH_BYTES)
        full = budgets * self.window / cost.tasks if cost.tasks else 0.0
        if held_up:
            self.window = 1
        elif full <= 1.0:
            self.window = min(self.window * 2, self._prefetch)
        elif full > 2.0:
            self.window = max(self.window // 2, 1)
        self._slow = held_up
        if self.broken is not None:
            raise self.broken


def _named(deliveries: Sequence[Delivery]) -> list[tuple[UUID, int]]:
    """The (task run, token) pairs ``deliveries`` name; an undecodable one is logged and left
    out (it is acked with its batch)."""
    wanted: list[tuple[UUID, int]] = []
    for delivery in deliveries:
        try:
            message = decode(delivery.body)
        except MessageError as exc:
            logger.error(
                "dropping an undecodable message: %s", exc, extra={"action": "bad_message"}
            )
            continue
        wanted.append((message.task_run_id, message.token))
    return wanted
