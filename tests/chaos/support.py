"""Helpers for the chaos tests: the private services, a restart-proof view of the database,
the broker's view of connections and queues, and log inspection.

RabbitMQ 3.10 evaluates ``consumer_timeout`` only when a channel's tick timer fires
(``rabbit_channel:handle_info(tick, ...)`` → ``evaluate_consumer_timeout``), and that timer
is armed with ``rabbit.channel_tick_interval`` milliseconds: 60 000 by default, and not exposed
in rabbitmq.conf. With the default, a 5 s ``consumer_timeout`` closes a channel anywhere
between 5 and ~65 s after the delivery. The chaos node therefore gets a 1 s tick at runtime
(``application:set_env``; a channel reads the setting each time it re-arms its timer), applied
again after every start, so the 5 s timeout is enforced within about 6 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pika
import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import WorkflowDef
from flowforge.errors import DatabaseUnavailableError
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from tests.conftest import TEST_EXECUTIONS_DDL
from tests.e2e import RoleProcess
from tests.harness import resources
from tests.harness.services import PrivatePostgres, PrivateRabbitMQ
from tests.store import Store

IN_CI = os.environ.get("CI", "").lower() == "true"

NODE_NAME = "flowforge-chaos"
#: rabbitmq.conf ``consumer_timeout`` of the chaos node (milliseconds).
CONSUMER_TIMEOUT_MS = 5_000
#: ``rabbit.channel_tick_interval`` set at runtime (milliseconds; the broker's default: 60 000).
CHANNEL_TICK_MS = 1_000
#: What RabbitMQ logs when it closes a channel for an unacknowledged delivery.
CONSUMER_TIMEOUT_LOG = "has timed out waiting for delivery acknowledgement"


def unavailable(message: str) -> None:
    """Skip locally, fail in CI: a missing service must never turn CI green."""
    if IN_CI:
        pytest.fail(f"required service missing in CI: {message}")
    pytest.skip(message)


def create_database(server_url: str) -> str:
    """A fresh database on the private server, migrated, with the test_executions table."""
    url = resources.create_database(server_url, "flowforge_chaos")
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TEST_EXECUTIONS_DDL)
    return url


# ------------------------------------------------------------------ the private services


@dataclass
class ChaosServices:
    """The private instances of this chaos session and the migrated database on them."""

    base_dir: Path
    pg: PrivatePostgres
    rabbit: PrivateRabbitMQ
    database_url: str = ""
    _tuned_pid: int | None = None  # the broker process the runtime settings were applied to

    def start_broker(self) -> None:
        """Start RabbitMQ (idempotent) and shorten the channel tick that enforces
        ``consumer_timeout`` (see module doc): a runtime setting, lost at every stop, so
        applied again after every start."""
        self.rabbit.start()
        pid = self.rabbit.pid
        if pid != self._tuned_pid:  # each rabbitmqctl call costs about a second
            self.rabbit.rabbitmqctl(
                "eval", f"application:set_env(rabbit, channel_tick_interval, {CHANNEL_TICK_MS})."
            )
            self._tuned_pid = pid

    def ensure_running(self) -> None:
        self.pg.start()
        self.start_broker()

    def broker_env(self, key: str) -> str:
        """``application:get_env(rabbit, key)`` as the node prints it, e.g. ``{ok,5000}``."""
        return self.rabbit.rabbitmqctl("eval", f"application:get_env(rabbit, {key}).").strip()

    def rabbit_log(self) -> str:
        path = self.rabbit.log_dir / f"{self.rabbit.node}.log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def queue_stats(self, queue: str) -> tuple[int, int] | None:
        """(messages, consumers) of ``queue`` as the broker reports them; None if absent.

        A quorum queue refreshes these counts on its own tick (``quorum_tick_interval``,
        5 s by default), so callers poll (:func:`wait_for_queue`) rather than read once.
        """
        out = self.rabbit.rabbitmqctl(
            "list_queues", "name", "messages", "consumers", "-q", "--no-table-headers"
        )
        for line in out.splitlines():
            fields = line.split("\t")
            if len(fields) == 3 and fields[0] == queue:
                if not (fields[1].isdigit() and fields[2].isdigit()):
                    return None  # a queue whose counts the broker cannot report yet
                return int(fields[1]), int(fields[2])
        return None

    def queue_exists(self, queue: str) -> bool:
        out = self.rabbit.rabbitmqctl("list_queues", "name", "-q", "--no-table-headers")
        return queue in out.split()

    def connection_of(self, os_pid: int) -> str | None:
        """The broker-side pid of the AMQP connection that process ``os_pid`` holds.

        The broker lists each connection with its peer (client-side) port; the client's
        socket with that local port is found in /proc/net/tcp and matched by inode against
        the sockets open in ``os_pid``.
        """
        out = self.rabbit.rabbitmqctl(
            "list_connections", "pid", "peer_port", "-q", "--no-table-headers"
        )
        inodes = _socket_inodes(os_pid)
        for line in out.splitlines():
            fields = line.split("\t")
            if len(fields) != 2 or not fields[1].isdigit():
                continue
            if _local_port_inodes(int(fields[1]), self.rabbit.amqp_port) & inodes:
                return fields[0]
        return None


def wait_for_queue(
    services: ChaosServices, queue: str, expected: tuple[int, int], timeout: float = 30.0
) -> None:
    """Poll ``rabbitmqctl list_queues`` until ``queue`` has (messages, consumers) ``expected``."""
    seen: list[tuple[int, int] | None] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(services.queue_stats(queue))
        if seen[-1] == expected:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"queue {queue}: expected (messages, consumers) {expected} within {timeout}s; "
        f"last seen {seen[-1] if seen else None}"
    )


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            match = re.fullmatch(r"socket:\[(\d+)\]", target)
            if match:
                found.add(int(match.group(1)))
    return found


def _local_port_inodes(local_port: int, remote_port: int) -> set[int]:
    """Inodes of IPv4 TCP sockets from ``local_port`` to ``remote_port`` (/proc/net/tcp)."""
    found = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = row.split()
        if len(cols) < 10:
            continue
        local, remote = cols[1].rsplit(":", 1)[1], cols[2].rsplit(":", 1)[1]
        if int(local, 16) == local_port and int(remote, 16) == remote_port:
            found.add(int(cols[9]))
    return found


# ------------------------------------------------------------------ the database, seen by tests


class ChaosDb:
    """The test's own view of the database. Reads use a fresh connection each, so they work
    across server restarts (a pooled connection would be dead after one)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2))
        self._db.open()
        self.repo = Store(self._db)

    def close(self) -> None:
        self._db.close()

    def trigger(self, workflow: WorkflowDef, run_input: dict[str, Any] | None = None) -> UUID:
        """Trigger a run; a pool left with dead connections by a restart is reset once."""
        try:
            return self.repo.trigger(workflow, run_input).run_id
        except DatabaseUnavailableError:
            self._db.reset()
            return self.repo.trigger(workflow, run_input).run_id

    def rows(self, query: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def value(self, query: str, params: tuple[object, ...] = ()) -> Any:
        found = self.rows(query, params)
        return found[0][0] if found else None

    def run_state(self, run_id: UUID) -> str | None:
        return self.value("SELECT state FROM workflow_runs WHERE id = %s", (run_id,))

    def states(self, run_ids: list[UUID]) -> dict[str, int]:
        """How many of ``run_ids`` are in each run state."""
        found = self.rows(
            "SELECT state, count(*) FROM workflow_runs WHERE id = ANY(%s) GROUP BY state",
            (run_ids,),
        )
        return {str(state): int(count) for state, count in found}

    def executions(self, run_id: UUID) -> list[tuple[UUID, int, int]]:
        """(task_run_id, attempt, pid) of every recorded handler execution of the run."""
        return [
            (UUID(str(t)), int(a), int(p))
            for t, a, p in self.rows(
                "SELECT task_run_id, attempt, pid FROM test_executions WHERE run_id = %s"
                " ORDER BY id",
                (run_id,),
            )
        ]

    def execution_counts(self, run_ids: list[UUID]) -> dict[UUID, int]:
        """Recorded executions per run (runs with none are absent)."""
        found = self.rows(
            "SELECT run_id, count(*) FROM test_executions WHERE run_id = ANY(%s) GROUP BY run_id",
            (run_ids,),
        )
        return {UUID(str(r)): int(c) for r, c in found}

    def outbox(self, run_id: UUID) -> list[tuple[int, UUID, int, Any]]:
        """(id, task_run_id, token, published_at) of the run's outbox rows, oldest first."""
        return [
            (int(i), UUID(str(t)), int(tok), pub)
            for i, t, tok, pub in self.rows(
                "SELECT o.id, o.task_run_id, o.fencing_token, o.published_at FROM outbox o"
                " JOIN task_runs t ON t.id = o.task_run_id WHERE t.run_id = %s ORDER BY o.id",
                (run_id,),
            )
        ]

    def pending_outbox(self, run_ids: list[UUID]) -> int:
        return int(
            self.value(
                "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
                " WHERE t.run_id = ANY(%s) AND o.published_at IS NULL",
                (run_ids,),
            )
        )

    def last_seen(self, pid: int) -> Any:
        """``last_seen_at`` of the registration of process ``pid`` (None if absent)."""
        return self.value("SELECT max(last_seen_at) FROM processes WHERE pid = %s", (pid,))


# ------------------------------------------------------------------ role processes


def count_in_log(process: RoleProcess, text: str) -> int:
    return process.log().count(text)


def reconnect_delays(process: RoleProcess) -> list[float]:
    """The delays announced by the role's "… reconnecting in X.Ys" lines, in order."""
    return [float(x) for x in re.findall(r"reconnecting in (\d+(?:\.\d+)?)s", process.log())]


@contextlib.contextmanager
def amqp_connection(url: str) -> Iterator[pika.BlockingConnection]:
    """A short-lived pika connection for the test itself."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        yield conn
    finally:
        if conn.is_open:
            with contextlib.suppress(Exception):
                conn.close()
