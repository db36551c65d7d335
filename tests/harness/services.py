"""Private PostgreSQL and RabbitMQ instances for tests and local development.

Each instance lives entirely under a base directory of its own (data, sockets, logs,
config, pid files, Erlang cookie), listens on 127.0.0.1 only, on ports chosen by the
caller, and never reads the machine's shared configuration (``/etc/postgresql``,
``/etc/rabbitmq``, ``/var/lib/rabbitmq/.erlang.cookie``). Processes are always addressed
by the pid this module recorded or read from the instance's own pid file, never by name.

When running as root the servers run as the ``postgres`` / ``rabbitmq`` accounts (the
PostgreSQL server refuses to run as root); otherwise they run as the current user.

Command line (``scripts/services`` runs it from the checkout)::

    python -m tests.harness.services start [--pg-port N] [--amqp-port N]
    python -m tests.harness.services stop | status | env | urls
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import stat
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from tests.harness import CHECKOUT

logger = logging.getLogger(__name__)

# --- locations and accounts ----------------------------------------------------------
PG_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
PG_PACKAGE = "postgresql-15"
PG_USER = "postgres"
PG_DATABASE = "flowforge"
PG_MAX_CONNECTIONS = 200
PG_SHARED_BUFFERS = "32MB"
RABBIT_BIN_DIR = Path("/usr/lib/rabbitmq/bin")
RABBIT_PACKAGE = "rabbitmq-server"
RABBIT_USER = "rabbitmq"
EPMD_NAME = "epmd"
ERL_DIST_LOOPBACK_ARGS = "-kernel inet_dist_use_interface {127,0,0,1}"
LOOPBACK = "127.0.0.1"
UNIX_SOCKET_PATH_MAX = 107  # bytes, sun_path minus the terminating NUL on Linux
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's, where /proc does not say

# --- timeouts (seconds) ----------------------------------------------------------------
PG_START_TIMEOUT_S = 60.0
PG_STOP_TIMEOUT_S = 30.0
RABBIT_START_TIMEOUT_S = 120.0
RABBIT_STOP_TIMEOUT_S = 60.0
EPMD_START_TIMEOUT_S = 10.0
KILL_WAIT_S = 10.0
ORPHAN_GRACE_S = 5.0
PORT_RELEASE_WAIT_S = 5.0
COMMAND_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.1
PID_FILE_ATTEMPTS = 5

# --- rabbitmq defaults --------------------------------------------------------------------
DEFAULT_HEARTBEAT_S = 60
COOKIE_LENGTH = 32

# --- command line defaults ------------------------------------------------------------------
DEFAULT_BASE_DIR = CHECKOUT / ".services"
BASE_DIR_ENV = "FLOWFORGE_SERVICES_DIR"
# Below the kernel's ephemeral range (32768-60999 on Linux): an outgoing connection of this
# machine is never given one, so a start never finds one taken by chance (55672 once was), and
# clear of RabbitMQ's own 25672 (a distribution port of the machine's broker). The private epmd
# takes DEFAULT_DIST_PORT + 1.
DEFAULT_PG_PORT = 26432
DEFAULT_AMQP_PORT = 26672
DEFAULT_DIST_PORT = 26673
#: Every port the dev services use by default (tests.harness.resources never hands them out).
DEFAULT_PORTS = frozenset(
    {DEFAULT_PG_PORT, DEFAULT_AMQP_PORT, DEFAULT_DIST_PORT, DEFAULT_DIST_PORT + 1}
)
DEFAULT_NODE_NAME = "flowforge-dev"
STATE_FILE_NAME = "services.json"
LOCK_FILE_NAME = "services.lock"
DATABASE_URL_ENV = "FLOWFORGE_TEST_DATABASE_URL"
BROKER_URL_ENV = "FLOWFORGE_TEST_BROKER_URL"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_RUNNING = 3


class ServiceError(RuntimeError):
    """A private service could not be started, stopped or inspected."""


class ServiceUnavailable(ServiceError):
    """A binary or system account the service needs is missing on this machine."""


# =========================================================================================
# process and file helpers
# =========================================================================================


@dataclass(frozen=True)
class _Account:
    """The OS account a service runs as; ``switch`` is False when no setuid is needed."""

    name: str
    uid: int
    gid: int
    switch: bool


def _service_account(name: str, package: str) -> _Account:
    """Return the account to run a server as: ``name`` when root, else the current user.

    Raises ServiceUnavailable (naming ``package``) when running as root and the
    account does not exist.
    """
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.geteuid())
        return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=False)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ServiceUnavailable(
            f"system user {name!r} not found; install the Debian package {package}"
        ) from None
    return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=True)


def _require_executables(paths: Sequence[Path], package: str) -> None:
    """Raise ServiceUnavailable naming ``package`` unless every path is executable."""
    missing = [str(p) for p in paths if not os.access(p, os.X_OK)]
    if missing:
        raise ServiceUnavailable(
            f"missing {', '.join(missing)}; install the Debian package {package}"
        )


def _which(name: str, package: str) -> Path:
    """Return the absolute path of executable ``name`` on PATH or raise ServiceUnavailable."""
    found = shutil.which(name)
    if found is None:
        raise ServiceUnavailable(f"{name} not found on PATH; install the Debian package {package}")
    return Path(found)


def _uid(account: _Account) -> int | None:
    """Popen ``user``: the account's uid when switching, else None (keep ours)."""
    return account.uid if account.switch else None


def _gid(account: _Account) -> int | None:
    """Popen ``group``: the account's gid when switching, else None (keep ours)."""
    return account.gid if account.switch else None


def _groups(account: _Account) -> list[int] | None:
    """Popen ``extra_groups``: none at all when switching (drop root's), else unchanged."""
    return [] if account.switch else None


def _run(
    argv: Sequence[str | Path],
    account: _Account,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``account`` and return it finished; raise ServiceError on failure.

    Output is captured, so ``argv`` must not leave a daemon holding stdout/stderr.
    ``timeout`` is in seconds; a command still running then is killed and reported.
    """
    args = [str(a) for a in argv]
    logger.debug("running %s", args)
    try:
        result = subprocess.run(  # fixed argument list, no shell
            args,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            user=_uid(account),
            group=_gid(account),
            extra_groups=_groups(account),
        )
    except subprocess.TimeoutExpired:
        raise ServiceError(f"{Path(args[0]).name} did not finish within {timeout:.0f} s") from None
    if result.returncode != 0:
        detail = _one_line(result.stderr or result.stdout)
        raise ServiceError(f"{Path(args[0]).name} {args[1:3]} failed: {detail}")
    return result


def _spawn_detached(
    argv: Sequence[str | Path],
    account: _Account,
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``account`` in its own session, output appended to ``log_path``."""
    args = [str(a) for a in argv]
    logger.debug("spawning %s", args)
    with log_path.open("ab") as log_file:
        _chown(log_path, account)
        return subprocess.Popen(  # fixed argument list, no shell
            args,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=_uid(account),
            group=_gid(account),
            extra_groups=_groups(account),
        )


def _one_line(text: str, limit: int = 400) -> str:
    """Collapse ``text`` to a single line of at most ``limit`` characters."""
    line = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line[:limit] if line else "(no output)"


def _tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of ``path`` as one line ("" if the file is unreadable)."""
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return _one_line("\n".join(content[-lines:]))


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def _pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie.

    Zombies count as dead: PID 1 on some machines never reaps orphans, so a killed
    daemon can linger as a zombie that ``kill(pid, 0)`` would still report as alive.
    """
    fields = _proc_stat(pid)
    return fields is not None and bool(fields) and fields[0] not in ("Z", "X")


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (identifies it across pid reuse)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _descendants(root_pid: int) -> dict[int, int | None]:
    """Live descendants of ``root_pid`` mapped to their start times (for later checks)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _proc_stat(pid)
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    found: dict[int, int | None] = {}
    pending = list(children.get(root_pid, []))
    while pending:
        pid = pending.pop()
        found[pid] = _start_time(pid)
        pending.extend(children.get(pid, []))
    return found


def _same_process_alive(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` is alive and still the process that had ``start_time``."""
    return _pid_alive(pid) and _start_time(pid) == start_time


def _reap_descendants(procs: Mapping[int, int | None]) -> None:
    """Give ``procs`` (from ``_descendants``) ORPHAN_GRACE_S to exit, then SIGKILL them."""
    try:
        _wait_until(
            lambda: not any(_same_process_alive(p, t) for p, t in procs.items()),
            ORPHAN_GRACE_S,
            "child processes to exit",
        )
    except ServiceError:
        for pid, start_time in procs.items():
            if _same_process_alive(pid, start_time):
                logger.warning("SIGKILL leftover child %s %s", pid, _proc_cmdline(pid))
                _kill_and_wait(pid)


def _proc_cmdline(pid: int) -> list[str]:
    """The argv of process ``pid`` ([] if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _proc_cwd(pid: int) -> Path | None:
    """The working directory of process ``pid`` (None if gone, a zombie or unreadable)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def _all_pids() -> Iterator[int]:
    """Every pid currently listed in /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def _read_pid_file(path: Path) -> int | None:
    """The pid on the first line of ``path`` (None if missing or malformed)."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every POLL_INTERVAL_S until true; ServiceError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise ServiceError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


def _kill_and_wait(pid: int, timeout: float = KILL_WAIT_S) -> None:
    """SIGKILL ``pid`` (which the caller has identified as ours) and wait for it to die."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_until(lambda: not _pid_alive(pid), timeout, f"pid {pid} to exit after SIGKILL")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (first, last)."""
    try:
        first, last = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


def _port_in_use(port: int) -> bool:
    """True if 127.0.0.1:``port`` cannot be bound (something already listens there).

    Binding (never connecting) means no other service is contacted by the check.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def _port_accepts(port: int) -> bool:
    """True if a TCP connection to 127.0.0.1:``port`` succeeds within CONNECT_TIMEOUT_S."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def _ensure_ports_free(ports: Mapping[str, int]) -> None:
    """Raise ServiceError naming the first of ``ports`` (label -> port) already in use."""
    for label, port in ports.items():
        if _port_in_use(port):
            raise ServiceError(f"{label} port {port} on {LOOPBACK} is already in use")


def _wait_ports_free(ports: Mapping[str, int]) -> None:
    """Wait up to PORT_RELEASE_WAIT_S for ``ports`` (label -> port) to be released.

    A SIGKILLed server's listening socket can outlive its process by some milliseconds.
    Raises ServiceError like ``_ensure_ports_free`` if a port is still taken afterwards.
    """
    with contextlib.suppress(ServiceError):
        _wait_until(
            lambda: not any(_port_in_use(p) for p in ports.values()),
            PORT_RELEASE_WAIT_S,
            "ports to be released",
        )
    _ensure_ports_free(ports)


def _chown(path: Path, account: _Account) -> None:
    """Give ``path`` to ``account`` when servers run under a different account."""
    if account.switch:
        os.chown(path, account.uid, account.gid)


def _ensure_base_dir(base_dir: Path) -> None:
    """Create ``base_dir`` itself (never its parents, which must already exist)."""
    if not base_dir.parent.is_dir():
        raise ServiceError(f"parent directory of base dir {base_dir} does not exist")
    base_dir.mkdir(mode=0o755, exist_ok=True)


def _make_dirs(account: _Account, *dirs: Path) -> None:
    """Create ``dirs`` (mode 0755 where new) owned by ``account``; parents are not chowned."""
    for directory in dirs:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        _chown(directory, account)


def _write_file(path: Path, content: str, account: _Account, mode: int = 0o644) -> None:
    """Write ``content`` to ``path`` with ``mode``, owned by ``account``."""
    path.write_text(content)
    path.chmod(mode)
    _chown(path, account)


def _account_groups(account: _Account) -> set[int]:
    """The group ids ``account`` belongs to (primary and supplementary)."""
    return set(os.getgrouplist(account.name, account.gid))


def _can_traverse(path: Path, account: _Account, groups: set[int]) -> bool:
    """True if ``account`` (member of ``groups``) may search directory ``path``."""
    info = path.stat()
    if info.st_uid == account.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in groups:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _check_traversable(path: Path, account: _Account) -> None:
    """Raise ServiceError unless ``account`` can reach ``path`` through every ancestor.

    Only matters when switching accounts: e.g. pytest's tmp dirs are mode 0700 root.
    """
    if not account.switch:
        return
    groups = _account_groups(account)
    for ancestor in [path, *path.parents]:
        if ancestor.exists() and not _can_traverse(ancestor, account, groups):
            raise ServiceError(
                f"user {account.name} cannot traverse {ancestor}; "
                "use a base dir whose ancestors are searchable (e.g. mode 0755)"
            )


def _process_env(extra: Mapping[str, str]) -> dict[str, str]:
    """A minimal child environment: PATH and a UTF-8 locale plus ``extra``.

    The caller's environment is deliberately not inherited so stray RABBITMQ_*, PG*
    or ERL_* variables cannot redirect a private instance at shared resources.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


# =========================================================================================
# PostgreSQL
# =========================================================================================


@dataclass(frozen=True)
class _PostmasterPid:
    """The fields of postmaster.pid this module uses."""

    pid: int
    data_dir: Path
    shm_key: int | None
    shm_id: int | None


@dataclass(frozen=True)
class _ShmSegment:
    """One row of /proc/sysvipc/shm."""

    key: int
    shm_id: int
    creator_pid: int
    attached: int


def _parse_postmaster_pid(text: str) -> _PostmasterPid | None:
    """Parse postmaster.pid contents (line 1 pid, line 2 data dir, line 7 shm key and id)."""
    lines = text.splitlines()
    if len(lines) < 2 or not lines[0].strip().isdigit():
        return None
    key: int | None = None
    shm_id: int | None = None
    fields = lines[6].split() if len(lines) >= 7 else []
    if len(fields) == 2 and all(f.lstrip("-").isdigit() for f in fields):
        key, shm_id = int(fields[0]), int(fields[1])
    return _PostmasterPid(int(lines[0]), Path(lines[1].strip()), key, shm_id)


def _sysv_segments() -> list[_ShmSegment]:
    """The SysV shared memory segments listed in /proc/sysvipc/shm."""
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return []
    segments = []
    for row in rows:
        cols = row.split()
        if len(cols) >= 7:
            segments.append(_ShmSegment(int(cols[0]), int(cols[1]), int(cols[4]), int(cols[6])))
    return segments


class PrivatePostgres:
    """A PostgreSQL 15 cluster in ``base_dir/pg-<port>/`` listening on 127.0.0.1:``port``.

    Authentication is ``trust`` for local and 127.0.0.1 connections; the superuser is
    ``postgres`` and the database ``flowforge`` is created on start. Not thread-safe.
    """

    def __init__(
        self,
        base_dir: Path,
        port: int,
        *,
        bin_dir: Path = PG_BIN_DIR,
        extra_settings: Sequence[str] = (),
    ) -> None:
        """Describe the instance; nothing is created or started until ``start()``.

        ``extra_settings`` are ``name = value`` lines appended to flowforge.conf (after the
        defaults, so they win), written at every start; e.g. replication settings.
        """
        self.base_dir = Path(base_dir).absolute()
        self.port = port
        self.bin_dir = bin_dir
        self.extra_settings = tuple(extra_settings)
        self.root = self.base_dir / f"pg-{port}"
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "run"
        self.log_file = self.root / "postgres.log"

    def __repr__(self) -> str:
        return f"PrivatePostgres(port={self.port}, data_dir={str(self.data_dir)!r})"

    @property
    def url(self) -> str:
        """libpq URL of the ``flowforge`` database (TCP on 127.0.0.1, user postgres)."""
        return f"postgresql://{PG_USER}@{LOOPBACK}:{self.port}/{PG_DATABASE}"

    @property
    def admin_url(self) -> str:
        """libpq URL of the ``postgres`` maintenance database."""
        return f"postgresql://{PG_USER}@{LOOPBACK}:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """Pid of this instance's live postmaster, or None if it is not running."""
        info = self._postmaster_pid()
        if info is None or not self._is_our_postmaster(info.pid):
            return None
        return info.pid

    def is_running(self) -> bool:
        """True if this instance's postmaster process is alive (it may still be starting)."""
        return self.pid is not None

    def start(self) -> None:
        """Start the cluster (initdb on first use) and wait until it accepts connections.

        Idempotent: a running instance only gets its database ensured. Recovers from a
        previous ``kill()`` (orphaned backends, stale postmaster.pid, stale SysV shm).
        Blocks at most about PG_START_TIMEOUT_S seconds.
        """
        account = self._check_prerequisites()
        if not self.is_running():
            self._clear_crash_leftovers(account)
            _wait_ports_free({"PostgreSQL": self.port})
            self._prepare(account)
            self._write_config(account)
            self._pg_ctl(account, "start", "-l", str(self.log_file), timeout=PG_START_TIMEOUT_S)
        _wait_until(
            self._accepts_connections, PG_START_TIMEOUT_S, f"{self!r} to accept connections"
        )
        self._ensure_database()
        logger.info("postgres ready on port %s (pid %s)", self.port, self.pid)

    def stop(self) -> None:
        """Stop with ``pg_ctl stop -m fast`` (SIGKILL as fallback), bounded in time.

        Also kills processes left over from a killed postmaster. No-op if not running.
        """
        account = _service_account(PG_USER, PG_PACKAGE)
        if self.is_running():
            try:
                self._pg_ctl(account, "stop", "-m", "fast", timeout=PG_STOP_TIMEOUT_S)
            except ServiceError as exc:
                logger.warning("fast shutdown failed (%s); SIGKILL", exc)
                self.kill()
        self._clear_crash_leftovers(account)
        logger.info("postgres on port %s stopped", self.port)

    def kill(self, *, clean: bool = False) -> None:
        """SIGKILL the postmaster (crash simulation) and wait for it to die.

        Its backends are left to notice on their own; the next ``start()`` cleans up.
        With ``clean`` the cleanup happens now instead: wait (up to ORPHAN_GRACE_S) for the
        orphaned backends to exit, then remove the SysV shm segment, the socket lock and
        postmaster.pid (for an instance that will not be started again, e.g. a failed-over
        primary). No-op if not running.
        """
        pid = self.pid
        if pid is None:
            logger.info("postgres on port %s not running; nothing to kill", self.port)
        else:
            logger.info("SIGKILL postgres postmaster %s", pid)
            _kill_and_wait(pid)
        if clean:
            self._clear_crash_leftovers(_service_account(PG_USER, PG_PACKAGE))

    def restart(self) -> None:
        """``stop()`` then ``start()``."""
        self.stop()
        self.start()

    # -- internals --------------------------------------------------------------------

    def _binary(self, name: str) -> Path:
        return self.bin_dir / name

    def _check_prerequisites(self) -> _Account:
        """Raise ServiceUnavailable if binaries or account are missing; return the account."""
        _require_executables(
            [self._binary(n) for n in ("initdb", "pg_ctl", "postgres")], PG_PACKAGE
        )
        return _service_account(PG_USER, PG_PACKAGE)

    def _prepare(self, account: _Account) -> None:
        """Create the private directories and run initdb if the cluster does not exist."""
        _ensure_base_dir(self.base_dir)
        _make_dirs(account, self.root, self.socket_dir)
        _check_traversable(self.root, account)
        socket_path = self.socket_dir / f".s.PGSQL.{self.port}"
        if len(os.fsencode(socket_path)) > UNIX_SOCKET_PATH_MAX:
            raise ServiceError(f"socket path too long ({socket_path}); use a shorter base dir")
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(account)

    def _initdb(self, account: _Account) -> None:
        """Create the cluster in data_dir (a half-initialised dir is removed first)."""
        if self.data_dir.exists():
            logger.warning("removing incomplete data dir %s", self.data_dir)
            shutil.rmtree(self.data_dir)
        logger.info("initdb %s", self.data_dir)
        argv: list[str | Path] = [
            self._binary("initdb"),
            "-D",
            self.data_dir,
            "-U",
            PG_USER,
            "-E",
            "UTF8",
            "--locale=C",
            "--auth-local=trust",
            "--auth-host=trust",
            "--no-sync",
        ]
        _run(argv, account, env=_process_env({}), cwd=self.root, timeout=PG_START_TIMEOUT_S)
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude = 'flowforge.conf'\n")

    def _write_config(self, account: _Account) -> None:
        """(Re)write data_dir/flowforge.conf, included last by postgresql.conf."""
        socket_dir = str(self.socket_dir).replace("'", "''")
        settings = [
            f"listen_addresses = '{LOOPBACK}'",
            f"port = {self.port}",
            f"unix_socket_directories = '{socket_dir}'",
            f"max_connections = {PG_MAX_CONNECTIONS}",
            f"shared_buffers = '{PG_SHARED_BUFFERS}'",
            "fsync = on",
            "logging_collector = off",
            *self.extra_settings,
        ]
        _write_file(self.data_dir / "flowforge.conf", "\n".join(settings) + "\n", account, 0o600)

    def _pg_ctl(self, account: _Account, action: str, *args: str, timeout: float) -> None:
        """Run ``pg_ctl <action> -w`` bounded by ``timeout`` s; include the log on failure."""
        argv: list[str | Path] = [
            self._binary("pg_ctl"),
            action,
            "-D",
            self.data_dir,
            "-w",
            "-s",
            "-t",
            str(int(timeout)),
            *args,
        ]
        try:
            _run(argv, account, env=_process_env({}), cwd=self.root, timeout=timeout + 5)
        except ServiceError as exc:
            raise ServiceError(f"{exc}; log: {_tail(self.log_file)}") from None

    def _postmaster_pid(self) -> _PostmasterPid | None:
        try:
            return _parse_postmaster_pid((self.data_dir / "postmaster.pid").read_text())
        except OSError:
            return None

    def _is_our_postmaster(self, pid: int) -> bool:
        """True if ``pid`` is alive and runs in this data dir (postgres chdirs there)."""
        return _pid_alive(pid) and _proc_cwd(pid) == self.data_dir

    def _accepts_connections(self) -> bool:
        try:
            with psycopg.connect(self.admin_url, connect_timeout=int(CONNECT_TIMEOUT_S)) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def _ensure_database(self) -> None:
        """Create database ``flowforge`` unless it exists."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            found = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (PG_DATABASE,)
            ).fetchone()
            if found is None:
                logger.info("creating database %s", PG_DATABASE)
                with contextlib.suppress(pg_errors.DuplicateDatabase):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(PG_DATABASE)))

    def _clear_crash_leftovers(self, account: _Account) -> None:
        """After a SIGKILLed postmaster: reap orphans, drop stale shm and postmaster.pid.

        Only processes whose cwd is this data dir and that run as ``account`` are killed;
        only the shm segment named in this data dir's postmaster.pid, created by that
        postmaster and with no attached process, is removed.
        """
        info = self._postmaster_pid()
        if info is None or self._is_our_postmaster(info.pid):
            return
        self._stop_orphans(account)
        if info.data_dir == self.data_dir:
            self._remove_stale_shm(info, account)
        self._remove_stale_socket_lock(info.pid)
        logger.info("removing stale postmaster.pid (pid %s is dead)", info.pid)
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)

    def _remove_stale_socket_lock(self, dead_pid: int) -> None:
        """Drop the socket and its .lock if the lock names ``dead_pid`` and this data dir.

        Needed because a SIGKILLed postmaster that nobody reaps stays a zombie, which
        PostgreSQL's own stale-lock check (``kill(pid, 0)``) takes for a live server.
        """
        socket_path = self.socket_dir / f".s.PGSQL.{self.port}"
        lock_path = Path(f"{socket_path}.lock")
        try:
            lines = lock_path.read_text().splitlines()
        except OSError:
            return
        if lines[:2] != [str(dead_pid), str(self.data_dir)]:
            logger.warning("leaving socket lock %s (not from pid %s)", lock_path, dead_pid)
            return
        logger.info("removing stale socket lock %s", lock_path)
        socket_path.unlink(missing_ok=True)
        lock_path.unlink(missing_ok=True)

    def _orphan_pids(self, account: _Account) -> list[int]:
        """Live processes of ``account`` whose working directory is this data dir."""
        own = os.getpid()
        return [
            pid
            for pid in _all_pids()
            if pid != own and _proc_cwd(pid) == self.data_dir and _owner(pid) == account.uid
        ]

    def _stop_orphans(self, account: _Account) -> None:
        """Give leftover backends ORPHAN_GRACE_S to exit, then SIGKILL them by pid."""
        try:
            _wait_until(lambda: not self._orphan_pids(account), ORPHAN_GRACE_S, "orphans")
        except ServiceError:
            for pid in self._orphan_pids(account):
                logger.warning("SIGKILL leftover postgres process %s %s", pid, _proc_cmdline(pid))
                _kill_and_wait(pid)

    def _remove_stale_shm(self, info: _PostmasterPid, account: _Account) -> None:
        """Remove the SysV segment recorded in postmaster.pid if the dead postmaster made it."""
        for seg in _sysv_segments():
            if (seg.key, seg.shm_id) != (info.shm_key, info.shm_id):
                continue
            if seg.creator_pid != info.pid or seg.attached != 0:
                logger.warning(
                    "leaving shm segment %s (creator %s, %s attached)",
                    seg.shm_id,
                    seg.creator_pid,
                    seg.attached,
                )
                return
            logger.info("removing stale shm segment key=%s id=%s", seg.key, seg.shm_id)
            ipcrm = _which("ipcrm", "util-linux")
            _run([str(ipcrm), "-m", str(seg.shm_id)], account, env=_process_env({}), cwd=self.root)


def _owner(pid: int) -> int | None:
    """The uid owning process ``pid`` (None if it is gone)."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


# =========================================================================================
# RabbitMQ
# =========================================================================================


class PrivateEpmd:
    """A foreground epmd on 127.0.0.1:``port`` (never the shared 4369).

    Erlang nodes register with, and look each other up in, the epmd on the port they are
    told (``ERL_EPMD_PORT``): a lone ``PrivateRabbitMQ`` runs one of its own, the nodes of
    a cluster share one. Addressed only by the pid it recorded in ``pid_file`` (checked to
    still be an epmd on ``port``); its output is appended to ``log_file``.
    """

    def __init__(self, port: int, pid_file: Path, log_file: Path) -> None:
        """Describe the daemon; nothing is started until ``start()``."""
        self.port = port
        self.pid_file = pid_file
        self.log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"PrivateEpmd(port={self.port})"

    @property
    def pid(self) -> int | None:
        """Pid of this epmd (recorded in ``pid_file``) if it is alive, else None."""
        pid = _read_pid_file(self.pid_file)
        if pid is None or not _pid_alive(pid):
            return None
        argv = _proc_cmdline(pid)
        if not argv or Path(argv[0]).name != EPMD_NAME or str(self.port) not in argv:
            return None
        return pid

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Run epmd as the rabbitmq account unless it already runs; wait for its port.

        ``env``: the daemon's environment (default: a minimal one). Raises ServiceError if
        the port is taken or epmd exits, after at most EPMD_START_TIMEOUT_S seconds.
        """
        if self.pid is not None:
            return
        account = _service_account(RABBIT_USER, RABBIT_PACKAGE)
        _ensure_ports_free({"epmd": self.port})
        argv: list[str | Path] = [
            _which(EPMD_NAME, RABBIT_PACKAGE),
            "-port",
            str(self.port),
            "-address",
            LOOPBACK,
        ]
        proc = _spawn_detached(
            argv,
            account,
            env=env if env is not None else _process_env({}),
            cwd=self.pid_file.parent,
            log_path=self.log_file,
        )
        self._proc = proc
        self.pid_file.write_text(f"{proc.pid}\n")
        _wait_until(
            lambda: _port_in_use(self.port) or proc.poll() is not None,
            EPMD_START_TIMEOUT_S,
            f"epmd on port {self.port}",
        )
        if proc.poll() is not None:
            raise ServiceError(f"epmd exited with {proc.returncode}: {_tail(self.log_file)}")

    def stop(self) -> None:
        """SIGTERM epmd by its recorded pid and wait; reap it if it is our child. Idempotent."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            if self._proc is not None and self._proc.pid == pid:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=KILL_WAIT_S)
            _wait_until(lambda: not _pid_alive(pid), KILL_WAIT_S, f"epmd {pid} to exit")
        self._proc = None
        self.pid_file.unlink(missing_ok=True)


class PrivateRabbitMQ:
    """A RabbitMQ node ``<node_name>@localhost`` under ``base_dir/rabbit-<node_name>/``.

    AMQP listens on 127.0.0.1:``amqp_port``, Erlang distribution on ``dist_port`` and a
    private epmd on ``epmd_port`` (default ``dist_port + 1``); the node has its own
    cookie (in its own HOME) and never reads /etc/rabbitmq. No plugins are enabled.
    Config changes (``set_consumer_timeout``) take effect on the next start.

    For a cluster (``tests.harness.cluster``) the nodes get one ``cookie`` and, with
    ``shared_epmd``, use an epmd on ``epmd_port`` that the caller runs.
    """

    def __init__(
        self,
        base_dir: Path,
        amqp_port: int,
        dist_port: int,
        node_name: str,
        *,
        epmd_port: int | None = None,
        consumer_timeout_ms: int | None = None,
        heartbeat_s: int = DEFAULT_HEARTBEAT_S,
        extra_config: Sequence[str] = (),
        bin_dir: Path = RABBIT_BIN_DIR,
        cookie: str | None = None,
        shared_epmd: bool = False,
    ) -> None:
        """Describe the node; nothing is created or started until ``start()``.

        ``consumer_timeout_ms``: rabbitmq.conf ``consumer_timeout`` (None = broker default).
        ``heartbeat_s``: server-suggested AMQP heartbeat in seconds.
        ``extra_config``: additional raw rabbitmq.conf lines, appended last.
        ``cookie``: the Erlang cookie (letters and digits; e.g. one shared by the nodes of a
        private cluster); None = a random one, made on the first start and kept.
        ``shared_epmd``: the epmd on ``epmd_port`` is run by the caller; this node neither
        starts nor stops one, and ``start()`` fails unless something listens there.
        """
        if cookie is not None and not (cookie.isascii() and cookie.isalnum()):
            raise ValueError("cookie must be a non-empty string of ASCII letters and digits")
        self.base_dir = Path(base_dir).absolute()
        self.amqp_port = amqp_port
        self.dist_port = dist_port
        self.epmd_port = epmd_port if epmd_port is not None else dist_port + 1
        self.node_name = node_name
        self.node = f"{node_name}@localhost"
        self.consumer_timeout_ms = consumer_timeout_ms
        self.heartbeat_s = heartbeat_s
        self.extra_config = list(extra_config)
        self.bin_dir = bin_dir
        self.root = self.base_dir / f"rabbit-{node_name}"
        self.home = self.root / "home"
        self.pid_file = self.root / "rabbit.pid"
        self.epmd_pid_file = self.root / "epmd.pid"
        self.config_file = self.root / "rabbitmq.conf"
        self.log_dir = self.root / "log"
        self.ports_file = self.root / "ports.json"
        self.cookie = cookie
        self.shared_epmd = shared_epmd
        self._epmd = PrivateEpmd(self.epmd_port, self.epmd_pid_file, self.log_dir / "epmd.log")

    def __repr__(self) -> str:
        return f"PrivateRabbitMQ(node={self.node!r}, amqp_port={self.amqp_port})"

    @property
    def url(self) -> str:
        """AMQP URL for the default vhost as ``guest`` (allowed from localhost only)."""
        return f"amqp://guest:guest@{LOOPBACK}:{self.amqp_port}/%2F"

    @property
    def pid(self) -> int | None:
        """Pid of this node's live beam.smp process, or None if it is not running."""
        pid = _read_pid_file(self.pid_file)
        if pid is None or not self._is_our_beam(pid):
            return None
        return pid

    def is_running(self) -> bool:
        """True if this node's Erlang VM is alive (the broker may still be booting)."""
        return self.pid is not None

    def set_consumer_timeout(self, ms: int | None) -> None:
        """Set rabbitmq.conf ``consumer_timeout`` in milliseconds (None = broker default).

        Rewrites the private config file; takes effect on the next start/restart.
        """
        self.consumer_timeout_ms = ms
        if self.root.exists():
            self._write_config(_service_account(RABBIT_USER, RABBIT_PACKAGE))

    def start(self) -> None:
        """Boot the node detached and wait until AMQP accepts connections.

        Idempotent. Blocks at most about RABBIT_START_TIMEOUT_S seconds (a boot
        typically takes 5-10 s; after a SIGKILL somewhat longer).
        """
        account = self._check_prerequisites()
        if self.is_running():
            self._check_running_ports()
            logger.info("rabbitmq node %s already running", self.node)
        else:
            _wait_ports_free({"AMQP": self.amqp_port, "Erlang distribution": self.dist_port})
            self._prepare(account)
            self._boot(account)
        _wait_until(
            lambda: _port_accepts(self.amqp_port),
            RABBIT_START_TIMEOUT_S,
            f"AMQP port {self.amqp_port}",
        )
        logger.info("rabbitmq ready on port %s (pid %s)", self.amqp_port, self.pid)

    def stop(self) -> None:
        """``rabbitmqctl stop <pidfile>`` (SIGKILL as fallback), then stop the private epmd.

        Bounded by about RABBIT_STOP_TIMEOUT_S seconds. No-op if nothing is running.
        """
        pid = self.pid
        if pid is not None:
            try:
                self.rabbitmqctl("stop", str(self.pid_file), timeout=RABBIT_STOP_TIMEOUT_S)
                _wait_until(lambda: not _pid_alive(pid), KILL_WAIT_S, f"beam {pid} to exit")
            except ServiceError as exc:
                logger.warning("graceful stop of %s failed (%s); SIGKILL", self.node, exc)
                self._kill_tree(pid)
        self.pid_file.unlink(missing_ok=True)
        if not self.shared_epmd:
            self._epmd.stop()
        logger.info("rabbitmq node %s stopped", self.node)

    def kill(self) -> None:
        """SIGKILL the beam.smp process (crash simulation) and wait for it to die.

        The private epmd keeps running so ``start()`` can follow. No-op if not running.
        """
        pid = self.pid
        if pid is None:
            logger.info("rabbitmq node %s not running; nothing to kill", self.node)
            return
        logger.info("SIGKILL rabbitmq beam %s", pid)
        self._kill_tree(pid)

    def _kill_tree(self, pid: int) -> None:
        """SIGKILL beam ``pid``, then wait for its helpers and its listening ports to go."""
        helpers = _descendants(pid)  # erl_child_setup, inet_gethost, ...
        _kill_and_wait(pid)
        _reap_descendants(helpers)
        _wait_ports_free({"AMQP": self.amqp_port, "Erlang distribution": self.dist_port})

    def restart(self) -> None:
        """``stop()`` then ``start()``."""
        self.stop()
        self.start()

    def rabbitmqctl(self, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run ``rabbitmqctl -n <node> *args`` against this node only; return stdout.

        Uses the private cookie and epmd. Raises ServiceError on failure or after
        ``timeout`` seconds.
        """
        ctl = self.bin_dir / "rabbitmqctl"
        _require_executables([ctl], RABBIT_PACKAGE)
        account = _service_account(RABBIT_USER, RABBIT_PACKAGE)
        argv: list[str | Path] = [ctl, "-n", self.node, *args]
        return _run(argv, account, env=self._env(), cwd=self.root, timeout=timeout).stdout

    # -- internals --------------------------------------------------------------------

    def _check_prerequisites(self) -> _Account:
        """Raise ServiceUnavailable if binaries or account are missing; return the account."""
        _require_executables(
            [self.bin_dir / n for n in ("rabbitmq-server", "rabbitmqctl")], RABBIT_PACKAGE
        )
        _which(EPMD_NAME, RABBIT_PACKAGE)
        return _service_account(RABBIT_USER, RABBIT_PACKAGE)

    def _prepare(self, account: _Account) -> None:
        """Create the private dirs, cookie (once) and config files."""
        _ensure_base_dir(self.base_dir)
        _make_dirs(
            account,
            self.root,
            self.home,
            self.log_dir,
            self.root / "mnesia",
            self.root / "conf.d",
        )
        _check_traversable(self.root, account)
        self._write_cookie(account)
        self._write_config(account)
        for name, content in (
            ("advanced.config", "[].\n"),
            ("enabled_plugins", "[].\n"),
            ("rabbitmq-env.conf", ""),
        ):
            _write_file(self.root / name, content, account)

    def _write_cookie(self, account: _Account) -> None:
        """Create HOME/.erlang.cookie (mode 0400): ``cookie`` if given, else a random one
        made once and reused across restarts."""
        path = self.home / ".erlang.cookie"
        if self.cookie is None:
            if path.exists():
                return
            value = "".join(secrets.choice(string.ascii_uppercase) for _ in range(COOKIE_LENGTH))
        else:
            with contextlib.suppress(OSError):
                if path.read_text() == self.cookie:
                    return
            path.unlink(missing_ok=True)  # read-only (0400): replace rather than rewrite
            value = self.cookie
        _write_file(path, value, account, 0o400)

    def _write_config(self, account: _Account) -> None:
        """(Re)write the private rabbitmq.conf from the current settings."""
        lines = [
            f"listeners.tcp.default = {LOOPBACK}:{self.amqp_port}",
            "loopback_users.guest = true",
            f"heartbeat = {self.heartbeat_s}",
        ]
        if self.consumer_timeout_ms is not None:
            lines.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        lines.extend(self.extra_config)
        _write_file(self.config_file, "\n".join(lines) + "\n", account)

    def _env(self) -> dict[str, str]:
        """Environment for server and CLI: every path private, epmd private, no autostart."""
        no_epmd = "-start_epmd false"
        return _process_env(
            {
                "HOME": str(self.home),
                "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_USE_LONGNAME": "false",
                "RABBITMQ_CONFIG_FILE": str(self.config_file),
                "RABBITMQ_CONFIG_FILES": str(self.root / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self.log_dir),
                "RABBITMQ_PID_FILE": str(self.pid_file),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": f"{ERL_DIST_LOOPBACK_ARGS} {no_epmd}",
                "RABBITMQ_CTL_ERL_ARGS": no_epmd,
                "ERL_EPMD_PORT": str(self.epmd_port),
                "ERL_EPMD_ADDRESS": LOOPBACK,
                "ERL_CRASH_DUMP": str(self.root / "erl_crash.dump"),
            }
        )

    def _is_our_beam(self, pid: int) -> bool:
        """True if ``pid`` is a live beam.smp whose ``-home`` is this node's private HOME."""
        if not _pid_alive(pid):
            return False
        argv = _proc_cmdline(pid)
        if not argv or "beam" not in Path(argv[0]).name:
            return False
        homes = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-home"]
        return str(self.home) in homes

    def _ports(self) -> dict[str, int]:
        return {"amqp": self.amqp_port, "dist": self.dist_port, "epmd": self.epmd_port}

    def _check_running_ports(self) -> None:
        """Raise ServiceError if the running node was booted with other ports than ours.

        Prevents waiting on (and so connecting to) a port this node does not own.
        """
        try:
            booted = json.loads(self.ports_file.read_text())
        except (OSError, ValueError):
            booted = None
        if booted != self._ports():
            raise ServiceError(
                f"node {self.node} is already running with ports {booted}, "
                f"not {self._ports()}; stop it first"
            )

    def _boot(self, account: _Account) -> None:
        """Start epmd if needed, run ``rabbitmq-server -detached`` and ``rabbitmqctl wait``."""
        self.pid_file.unlink(missing_ok=True)  # a stale pid would confuse `rabbitmqctl wait`
        if self.shared_epmd:
            if not _port_in_use(self.epmd_port):
                raise ServiceError(f"no epmd listens on shared epmd port {self.epmd_port}")
        else:
            self._epmd.start(self._env())
        _write_file(self.ports_file, json.dumps(self._ports()) + "\n", account)
        started = time.monotonic()
        server: list[str | Path] = [self.bin_dir / "rabbitmq-server", "-detached"]
        launcher = _spawn_detached(
            server, account, env=self._env(), cwd=self.root, log_path=self.log_dir / "detached.log"
        )
        try:
            launcher.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ServiceError("rabbitmq-server -detached did not return") from None
        # rabbitmq-server writes its pid file in pieces: `rabbitmqctl wait` that reads it too
        # early fails with garbage_in_pid_file instead of waiting, so wait for a whole pid first
        _wait_until(
            lambda: _read_pid_file(self.pid_file) is not None,
            RABBIT_START_TIMEOUT_S,
            f"{self.pid_file} to hold a pid",
        )
        for attempt in range(1, PID_FILE_ATTEMPTS + 1):
            try:
                self.rabbitmqctl(
                    "wait",
                    "--timeout",
                    str(int(RABBIT_START_TIMEOUT_S)),
                    str(self.pid_file),
                    timeout=RABBIT_START_TIMEOUT_S + 10,
                )
                break
            except ServiceError as exc:
                if "garbage_in_pid_file" in str(exc) and attempt < PID_FILE_ATTEMPTS:
                    time.sleep(POLL_INTERVAL_S)  # caught the pid file half-written: read again
                    continue
                log = _tail(self.log_dir / f"{self.node}.log")
                raise ServiceError(f"{exc}; log: {log}") from None
        logger.info("rabbitmq node %s booted in %.1f s", self.node, time.monotonic() - started)


# =========================================================================================
# command line
# =========================================================================================


@dataclass(frozen=True)
class _CliConfig:
    """Where the dev services live and which ports they use."""

    base_dir: Path
    pg_port: int
    amqp_port: int
    dist_port: int
    node_name: str = DEFAULT_NODE_NAME

    def postgres(self) -> PrivatePostgres:
        return PrivatePostgres(self.base_dir, self.pg_port)

    def rabbitmq(self) -> PrivateRabbitMQ:
        return PrivateRabbitMQ(self.base_dir, self.amqp_port, self.dist_port, self.node_name)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="services", description="Private PostgreSQL + RabbitMQ for FlowForge tests."
    )
    parser.add_argument(
        "--base-dir",
        type=Path,
        default=None,
        help=f"state directory (default ${BASE_DIR_ENV} or {DEFAULT_BASE_DIR})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("start", "start both services (idempotent) and print their URLs"),
        ("stop", "stop both services"),
        ("status", "show state; exit 0 if both run, 3 otherwise"),
        ("env", "print export lines for the test URLs"),
        ("urls", "print the URLs"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--pg-port", type=int, default=None)
        sub.add_argument("--amqp-port", type=int, default=None)
        sub.add_argument("--dist-port", type=int, default=None)
    return parser


def _load_state(base_dir: Path) -> dict[str, int]:
    """Ports recorded by the last ``start`` ({} if none)."""
    try:
        data = json.loads((base_dir / STATE_FILE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def _resolve_config(args: argparse.Namespace) -> _CliConfig:
    """Ports from the command line, else from the last ``start``, else the defaults."""
    base_dir = args.base_dir or Path(os.environ.get(BASE_DIR_ENV, DEFAULT_BASE_DIR))
    state = _load_state(base_dir)
    amqp_port = args.amqp_port or state.get("amqp_port", DEFAULT_AMQP_PORT)
    default_dist = DEFAULT_DIST_PORT if amqp_port == DEFAULT_AMQP_PORT else amqp_port + 1
    return _CliConfig(
        base_dir=base_dir.absolute(),
        pg_port=args.pg_port or state.get("pg_port", DEFAULT_PG_PORT),
        amqp_port=amqp_port,
        dist_port=args.dist_port or state.get("dist_port", default_dist),
    )


@contextlib.contextmanager
def _locked(base_dir: Path) -> Iterator[None]:
    """Serialise CLI invocations sharing ``base_dir`` with an exclusive flock."""
    _ensure_base_dir(base_dir)
    with (base_dir / LOCK_FILE_NAME).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _print_urls(cfg: _CliConfig) -> None:
    print(f"database: {cfg.postgres().url}")
    print(f"broker:   {cfg.rabbitmq().url}")


def _cmd_start(cfg: _CliConfig) -> int:
    _warn_if_ephemeral(cfg)
    with _locked(cfg.base_dir):
        cfg.postgres().start()
        cfg.rabbitmq().start()
        state = {"pg_port": cfg.pg_port, "amqp_port": cfg.amqp_port, "dist_port": cfg.dist_port}
        (cfg.base_dir / STATE_FILE_NAME).write_text(json.dumps(state) + "\n")
    _print_urls(cfg)
    return EXIT_OK


def _warn_if_ephemeral(cfg: _CliConfig) -> None:
    """One stderr line per port of ``cfg`` in the ephemeral range (e.g. recorded by a start
    before the defaults moved below it): an outgoing connection may hold it at any start."""
    first, last = ephemeral_range()
    for label, port in (("PostgreSQL", cfg.pg_port), ("AMQP", cfg.amqp_port)):
        if first <= port <= last:
            print(
                f"services: warning: {label} port {port} is in this machine's ephemeral range "
                f"({first}-{last}), where an outgoing connection may take it; to move to the "
                f"defaults: stop, remove {cfg.base_dir / STATE_FILE_NAME}, start",
                file=sys.stderr,
            )


def _cmd_stop(cfg: _CliConfig) -> int:
    with _locked(cfg.base_dir):
        cfg.rabbitmq().stop()
        cfg.postgres().stop()
    print("stopped")
    return EXIT_OK


def _cmd_status(cfg: _CliConfig) -> int:
    running = 0
    for label, service in (("postgres", cfg.postgres()), ("rabbitmq", cfg.rabbitmq())):
        pid = service.pid
        state = f"running (pid {pid})" if pid is not None else "stopped"
        running += pid is not None
        print(f"{label:<9} {state:<22} {service.url}")
    return EXIT_OK if running == 2 else EXIT_NOT_RUNNING


def _cmd_env(cfg: _CliConfig) -> int:
    print(f"export {DATABASE_URL_ENV}={shlex.quote(cfg.postgres().url)}")
    print(f"export {BROKER_URL_ENV}={shlex.quote(cfg.rabbitmq().url)}")
    return EXIT_OK


def _cmd_urls(cfg: _CliConfig) -> int:
    _print_urls(cfg)
    return EXIT_OK


_COMMANDS: dict[str, Callable[[_CliConfig], int]] = {
    "start": _cmd_start,
    "stop": _cmd_stop,
    "status": _cmd_status,
    "env": _cmd_env,
    "urls": _cmd_urls,
}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (errors: one stderr line, status 1)."""
    args = _build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return _COMMANDS[args.command](_resolve_config(args))
    except (ServiceError, OSError) as exc:
        print(f"services: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
