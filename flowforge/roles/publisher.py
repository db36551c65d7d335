"""The publisher role: drains the outbox into the quorum queue.

Each sweep locks a batch of pending outbox rows (``FOR UPDATE SKIP LOCKED``, so publishers
divide the queue), publishes them as one confirm window and stamps exactly the rows the broker
confirmed, in the same transaction. A NOTIFY while the sweep awaits its confirms lets pending
rows of a higher priority than its lowest join it (the priority lane, docs/flow-control.md
"Priorities"): they do not wait for the sweep in flight. A failed, unroutable or unconfirmed
publish leaves its row pending for the next sweep. While idle, the broker connection's I/O loop
runs (heartbeats) until a NOTIFY on the outbox channel or the poll interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from flowforge.broker.publish import ConfirmingPublisher
from flowforge.config import Config
from flowforge.domain.model import Dispatch
from flowforge.roles.presence import Presence
from flowforge.roles.stopping import stop_fd
from flowforge.store.db import Database
from flowforge.store.notify import OUTBOX_CHANNEL, Listener
from flowforge.store.outbox import More, Outbox
from flowforge.store.processes import Processes
from flowforge.telemetry import Telemetry

logger = logging.getLogger(__name__)

#: Rows per sweep: one confirm window.
PUBLISH_BATCH = 500


class PublisherStatements(Outbox, Processes):
    """The publisher's part of the store: the outbox, and its registry row."""


class Publisher:
    """The publisher role (see module docstring)."""

    title = "Publisher"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        batch_size: int = PUBLISH_BATCH,
    ) -> None:
        self._config = config
        self._batch_size = batch_size
        self._db = Database(config.database, application_name="flowforge-publisher")
        self._repo = PublisherStatements(self._db)
        self._listener = Listener(config.database, OUTBOX_CHANNEL)
        self._broker = ConfirmingPublisher(config.broker)
        self._presence = Presence(self._repo, "publisher")
        self._more: More | None = None  # the sweep in flight's lane (publish_outbox)
        self._woken = False  # a NOTIFY was read during the sweep: sweep again, do not idle

    def initialize(self) -> None:
        self._db.open()
        self._listener.open()
        self._broker.connect()
        self._presence.announce()

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        poll = self._config.scheduler.poll_interval_s
        stopped = stop_fd(stop)  # the idle wait ends at a stop, not at its poll
        while not stop.is_set():
            self._listener.drain()
            self._woken = False
            handed, _stamped = self.sweep()
            self._presence.tick()
            beat()
            if handed < self._batch_size and not self._woken:
                wake = self._listener.fileno()
                self._broker.idle(poll, wake_fds=(wake,) if stopped is None else (wake, stopped))

    def sweep(self) -> tuple[int, int]:
        """Publish one batch; return (rows handed to the broker, rows stamped)."""
        handed, stamped = self._repo.publish_outbox(
            self._batch_size, self.send, self._broker.refused(), self._lane
        )
        if handed != stamped:
            logger.warning(
                "%d of %d outbox row(s) not confirmed; they stay pending",
                handed - stamped,
                handed,
                extra={"action": "publish_unconfirmed"},
            )
        return handed, stamped

    def send(self, batch: Sequence[Dispatch]) -> set[int]:
        """Publish ``batch`` and return the confirmed outbox ids (a seam for tests); a NOTIFY
        while the confirms are awaited lets higher-priority rows join (the priority lane)."""
        if self._more is None:
            return self._broker.publish(batch)
        return self._broker.publish(batch, more=self._joining, wake_fd=self._listener.fileno())

    def _lane(self, more: More | None) -> None:
        self._more = more

    def _joining(self) -> list[Dispatch]:
        """The NOTIFY read (so the wake is quiet again), the rows that join the sweep."""
        self._listener.drain()
        self._woken = True
        return self._more() if self._more is not None else []

    def reset(self) -> None:
        self._broker.close()
        self._listener.close()
        self._db.close()

    def shutdown(self) -> None:
        self._presence.leave()
        self.reset()
