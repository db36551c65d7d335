"""Small shared pieces for tests, benchmarks and the chaos soak: scratch databases, free ports,
child processes, a ``flowforge up`` tree. One definition each, instead of one per harness."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import random
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from flowforge.orphans import stop_with_parent
from tests.harness import CHECKOUT
from tests.harness.services import DEFAULT_PORTS, ephemeral_range


def create_database(server_url: str, prefix: str) -> str:
    """Create an empty database named ``<prefix>_<random>`` on ``server_url``; return its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_url)
    params["dbname"] = name
    return make_conninfo("", **params)


def drop_database(server_url: str, database_url: str) -> None:
    """Drop the database ``database_url`` names, ending its sessions (a scratch database)."""
    name = str(conninfo_to_dict(database_url)["dbname"])
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


#: Where :func:`free_ports` draws from: up to the kernel's ephemeral range, from here.
PORT_FLOOR = 20000
#: One shared file; a port is reserved by a byte-range lock at its number (see free_ports).
RESERVATIONS = Path(tempfile.gettempdir()) / "flowforge-test-ports.lock"
_DRAWS_PER_PORT = 50  # candidates tried per port asked for before giving up


class _Reservations:
    """The ports this process holds: byte-range locks on :data:`RESERVATIONS`, released by the
    kernel when the process ends. A POSIX lock is the process's: another process cannot take
    it, and this one must not close any descriptor of the file while it lives (it never does).
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._opened = False
        self.held: set[int] = set()

    def take(self, port: int) -> bool:
        """Reserve ``port`` for this process; False if it is already held (here or elsewhere)."""
        if port in self.held:
            return False
        fd = self._file()
        if fd is not None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
            except OSError:  # EAGAIN / EACCES: another test process holds it
                return False
        self.held.add(port)
        return True

    def _file(self) -> int | None:
        """The shared file, opened once; None where it cannot be (then ports are only
        checked free, not reserved)."""
        if not self._opened:
            self._opened = True
            try:
                self._fd = os.open(RESERVATIONS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError:
                self._fd = None
            else:
                with contextlib.suppress(OSError):  # another account's tests reserve here too
                    os.fchmod(self._fd, 0o666)
        return self._fd


_reservations = _Reservations()


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that nothing listens on, reserved for this process.

    They come from below the kernel's ephemeral range (:data:`PORT_FLOOR` up to it, without the
    dev services' defaults), so no
    outgoing connection of this machine is ever given one — neither between this choice and
    the server's bind nor while a test has stopped the server that owns it (the flake of a fixed
    or bind-to-0 port in that range). A port something is bound to is skipped, and each port is
    reserved until this process ends, so two test processes never get the same one. A port
    still taken by another program between the choice and the bind fails that start with a
    message naming it (``tests.harness.services``: "AMQP port N on 127.0.0.1 is already in
    use"). Raises RuntimeError if ``count`` ports cannot be found.
    """
    first, _last = ephemeral_range()
    candidates = [p for p in range(PORT_FLOOR, first) if p not in DEFAULT_PORTS]
    random.shuffle(candidates)
    return choose_ports(count, candidates[: count * _DRAWS_PER_PORT])


def choose_ports(count: int, candidates: Iterable[int]) -> list[int]:
    """The first ``count`` of ``candidates`` that are bindable on 127.0.0.1 now and not held by
    any test process (see :func:`free_ports`); they are reserved for this process."""
    chosen: list[int] = []
    for port in candidates:
        if len(chosen) == count:
            break
        if port not in _reservations.held and _bindable(port) and _reservations.take(port):
            chosen.append(port)
    if len(chosen) < count:
        raise RuntimeError(
            f"found only {len(chosen)} of {count} free port(s) below the "
            f"ephemeral range (from {PORT_FLOOR})"
        )
    return chosen


def _bindable(port: int) -> bool:
    """True if 127.0.0.1:``port`` can be bound now (no SO_REUSEADDR: a port in TIME_WAIT
    counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def child_pids(pid: int, recursive: bool = False) -> list[int]:
    """The children of ``pid`` (and theirs, with ``recursive``), read from /proc."""
    try:
        found = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    if recursive:
        found += [g for c in found for g in child_pids(c, recursive=True)]
    return found


def start_tree(config: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``flowforge -c CONFIG up`` from the checkout, its stderr appended to ``log``.

    The working directory is the checkout: under ``python -m`` the interpreter puts it first on
    ``sys.path``, and ``flowforge up`` hands that entry to the tree it execs (PATH0,
    flowforge/tree.py), so handler modules of the harness named in ``config``
    (``tests.harness.bench_handlers``) import from this checkout wherever the caller runs.
    """
    with log.open("ab") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=CHECKOUT,
            env=dict(env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            # a harness killed (pytest's timeout cut a soak short once) leaves no tree behind
            preexec_fn=functools.partial(stop_with_parent, os.getpid()),
        )
