"""The publisher role: drains the outbox into the quorum queue.

Each sweep locks a batch of pending outbox rows (``FOR UPDATE SKIP LOCKED``, so publishers
divide the queue), publishes them as one confirm window and stamps exactly the rows the broker
confirmed, in the same transaction. A failed, unroutable or unconfirmed publish leaves its row
pending for the next sweep. While idle, the broker connection's I/O loop runs (heartbeats)
until a NOTIFY on the outbox channel or the poll interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from flowforge.broker.publish import ConfirmingPublisher
from flowforge.config import Config
from flowforge.domain.model import Dispatch
from flowforge.roles.presence import Presence
from flowforge.store.db import Database
from flowforge.store.notify import OUTBOX_CHANNEL, Listener
from flowforge.store.outbox import Outbox
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

    def initialize(self) -> None:
        self._db.open()
        self._listener.open()
        self._broker.connect()
        self._presence.announce()

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        poll = self._config.scheduler.poll_interval_s
        while not stop.is_set():
            self._listener.drain()
            handed, _stamped = self.sweep()
            self._presence.tick()
            beat()
            if handed < self._batch_size:
                self._broker.idle(poll, wake_fd=self._listener.fileno())

    def sweep(self) -> tuple[int, int]:
        """Publish one batch; return (rows handed to the broker, rows stamped)."""
        handed, stamped = self._repo.publish_outbox(
            self._batch_size, self.send, self._broker.refused()
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
        """Publish ``batch`` and return the confirmed outbox ids (a seam for tests)."""
        return self._broker.publish(batch)

    def reset(self) -> None:
        self._broker.close()
        self._listener.close()
        self._db.close()

    def shutdown(self) -> None:
        self._presence.leave()
        self.reset()
