"""A role process's entry in the process registry (host, pid, role, last seen by the DB clock)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from flowforge.roles.seams import Registry

logger = logging.getLogger(__name__)

#: How often a live process refreshes its ``last_seen_at`` (seconds).
TOUCH_INTERVAL_S = 5.0


class Presence:
    """Registers on :meth:`announce`, refreshes on :meth:`tick`, deregisters on :meth:`leave`."""

    def __init__(self, repo: Registry, role: str, queue: str | None = None) -> None:
        """``queue``: the queue a worker consumes, recorded with its row (None: not a worker)."""
        self.id = uuid.uuid4()
        self._repo = repo
        self._role = role
        self._queue = queue
        self._last_touch = 0.0
        self._announced = False

    def announce(self) -> None:
        self._repo.register_process(
            self.id, socket.gethostname(), os.getpid(), self._role, self._queue
        )
        self._last_touch = time.monotonic()
        self._announced = True

    def tick(self) -> None:
        """Refresh (or re-create) the registration if :data:`TOUCH_INTERVAL_S` has passed."""
        if time.monotonic() - self._last_touch >= TOUCH_INTERVAL_S:
            self.announce()

    def leave(self) -> None:
        """Deregister; if the database is gone, the scheduler forgets the silent row later.

        Nothing to do for a process that never registered (a boot that failed before): no
        wait on a database that refused it."""
        if not self._announced:
            return
        try:
            self._repo.deregister_process(self.id)
        except Exception:  # shutting down: nothing to do about a failure but note it
            logger.debug("could not deregister", exc_info=True)
