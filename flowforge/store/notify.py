"""Prompt wake-ups through PostgreSQL ``LISTEN/NOTIFY``.

A :class:`Listener` owns one autocommit connection that LISTENs on a channel. Roles call
:meth:`Listener.drain` *before* looking for work and :meth:`Listener.wait` only after a pass
found nothing: a notification that lands during the pass stays queued and ends the next wait
at once, so no wake-up is lost (polling stays as the safety net).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from flowforge.config import DatabaseConfig
from flowforge.errors import DatabaseUnavailableError
from flowforge.store.db import session_options, translate_errors

SCHEDULER_CHANNEL = "flowforge_scheduler"
OUTBOX_CHANNEL = "flowforge_outbox"
#: A run was asked to stop (payload: its id); workers running its tasks listen.
CANCEL_CHANNEL = "flowforge_cancel"


class Listener:
    """One LISTENing connection; opened after fork, reopened by the role after a failure."""

    def __init__(self, config: DatabaseConfig, channel: str) -> None:
        self._config = config
        self._channel = channel
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def open(self) -> None:
        with translate_errors():
            self._conn = psycopg.connect(
                self._config.url,
                autocommit=True,
                connect_timeout=max(1, int(self._config.connect_timeout_s)),
                options=session_options(self._config),
                application_name=f"flowforge-listen-{self._channel}",
            )
            self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def fileno(self) -> int:
        return self._connection().fileno()

    def drain(self) -> int:
        """Consume every notification already received; return how many there were."""
        with translate_errors():
            return sum(1 for _ in self._connection().notifies(timeout=0))

    def wait(self, timeout_s: float) -> bool:
        """Block until a notification arrives (True) or ``timeout_s`` passes (False)."""
        with translate_errors():
            for _ in self._connection().notifies(timeout=timeout_s, stop_after=1):
                return True
        return False

    def receive(self, timeout_s: float) -> list[str]:
        """Block until notifications arrive or ``timeout_s`` passes; return the payloads of
        every notification received by then (none on a timeout)."""
        with translate_errors():
            conn = self._connection()
            payloads = [n.payload for n in conn.notifies(timeout=timeout_s, stop_after=1)]
            if payloads:
                payloads += [n.payload for n in conn.notifies(timeout=0)]
        return payloads

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            raise DatabaseUnavailableError(f"listener on {self._channel} is not connected")
        return self._conn
