"""A real ``flowforge up`` tree for your integration tests, with no pytest needed
(``flowforge.testing.pytest`` wraps it in a fixture; docs/testing-workflows.md).

:class:`TestTree` runs ``python -m flowforge.cli -c CONFIG up`` as a child process on the
database and broker you name (the config's, or URLs given here, passed to the tree the way an
operator would: ``FLOWFORGE_DATABASE_URL``, ``FLOWFORGE_BROKER_URL``), migrates the database
first, and knows the tree is ready when its supervisor says ``READY=1`` on the service
manager's protocol (a private ``NOTIFY_SOCKET``: the same message systemd waits for, whatever
the log level). It stops the tree as an operator does: SIGTERM to the supervisor's pid, a
bounded wait for the drain, SIGKILL only past it (the children die with the supervisor); and
should the test process itself be killed, the supervisor gets SIGTERM from the kernel.
:func:`scratch_database` makes an empty database for one test session and
:func:`drop_database` removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from flowforge.client import Client
from flowforge.config import Config, load_config
from flowforge.orphans import stop_with_parent
from flowforge.store.migrate import migrate

#: Seconds to wait for the tree's ``READY=1`` unless told otherwise.
READY_TIMEOUT_S = 60.0
#: Seconds allowed past the config's ``processes.drain_timeout_s`` before SIGKILL.
STOP_MARGIN_S = 10.0
#: Longest single wait for a notification, so a tree that died is noticed promptly.
_POLL_S = 0.2


class TreeError(RuntimeError):
    """The tree did not start (it exited, or was not ready in time); the message ends with
    the tail of its log."""


def scratch_database(server_url: str, prefix: str = "flowforge_test") -> str:
    """Create an empty database ``<prefix>_<random>`` on the server of ``server_url`` (the
    connection goes to its maintenance database ``postgres``; the role needs CREATEDB) and
    return the URL of the new database (``server_url`` with its name)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_maintenance(server_url), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return _with_dbname(server_url, name)


def drop_database(database_url: str) -> None:
    """Drop the database ``database_url`` names, ending its sessions first (PostgreSQL 13+)."""
    name = str(conninfo_to_dict(database_url)["dbname"])
    with psycopg.connect(_maintenance(database_url), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _maintenance(url: str) -> str:
    return _with_dbname(url, "postgres")


def _with_dbname(url: str, name: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = name
    return make_conninfo("", **params)


class TestTree:
    """One ``flowforge up`` of ``config`` (a path), its stderr in ``log_path``.

    ``database_url`` / ``broker_url`` replace the config's (None: the config's, or the
    ``FLOWFORGE_*`` variables of this process). ``env``: the tree's environment (default this
    process's); ``cwd``: its working directory, first on its ``sys.path`` (default this
    process's), so handler modules import there as in your tests.
    """

    __test__ = False  # a class named Test*: not a test class for pytest

    def __init__(
        self,
        config: str | Path,
        log_path: str | Path,
        *,
        database_url: str | None = None,
        broker_url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.config_path = Path(config)
        self.log_path = Path(log_path)
        loaded = load_config(self.config_path)
        if database_url is not None:
            loaded = dataclasses.replace(
                loaded, database=dataclasses.replace(loaded.database, url=database_url)
            )
        self.config: Config = loaded
        self._env = dict(os.environ if env is None else env)
        if database_url is not None:
            self._env["FLOWFORGE_DATABASE_URL"] = database_url
        if broker_url is not None:
            self._env["FLOWFORGE_BROKER_URL"] = broker_url
        self._cwd = Path.cwd() if cwd is None else Path(cwd)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The supervisor's pid (None before :meth:`start`)."""
        return None if self.proc is None else self.proc.pid

    def client(self) -> Client:
        """A :class:`~flowforge.Client` on the tree's config and database (not opened)."""
        return Client(self.config)

    def log(self) -> str:
        """The tree's log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Migrate the database, start the tree and return once every role is ready;
        :class:`TreeError` (the tree stopped) if it exits or is not ready in time."""
        migrate(self.config.database.url)
        address = f"@flowforge-test-{uuid.uuid4().hex}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind("\0" + address[1:])
            env = {**self._env, "NOTIFY_SOCKET": address}
            for name in ("WATCHDOG_USEC", "WATCHDOG_PID"):  # ours, should a manager run us
                env.pop(name, None)
            with self.log_path.open("ab") as log:
                self.proc = _spawn(self.config_path, env, self._cwd, log)
            try:
                self._await_ready(notify, ready_timeout_s)
            except TreeError:
                self.stop()
                raise

    def _await_ready(self, notify: socket.socket, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.proc.poll() is not None:
                raise TreeError(self._failed(f"the tree exited with {self.proc.returncode}"))
            notify.settimeout(min(_POLL_S, left))
            try:
                message = notify.recv(4096).decode(errors="replace")
            except TimeoutError:
                continue
            if "READY=1" in message.split("\n"):
                return
        raise TreeError(self._failed(f"the tree was not ready within {timeout_s:g}s"))

    def _failed(self, what: str) -> str:
        tail = self.log()[-4000:]
        return f"{what} (config {self.config_path}); its log ends:\n{tail}"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM the supervisor and wait for the drain (``timeout_s``, default the config's
        ``processes.drain_timeout_s`` plus :data:`STOP_MARGIN_S`), SIGKILL past it; return
        its exit code (None if it was never started). Safe to call twice."""
        proc = self.proc
        if proc is None:
            return None
        if timeout_s is None:
            timeout_s = self.config.processes.drain_timeout_s + STOP_MARGIN_S
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(STOP_MARGIN_S)
        return proc.returncode


def _spawn(
    config: Path, env: Mapping[str, str], cwd: Path, log: IO[bytes]
) -> subprocess.Popen[bytes]:
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config.resolve()), "up"],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
        preexec_fn=lambda: stop_with_parent(parent),
    )
