"""A private PostgreSQL 15 cluster: its own data directory, port, socket and log.

Listens on 127.0.0.1 only and never reads the machine's shared configuration
(``/etc/postgresql``). Used by ``flowforge dev`` and by the test harness.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from flowforge.devservices.procs import (
    CONNECT_TIMEOUT_S,
    LOOPBACK,
    ORPHAN_GRACE_S,
    Account,
    ServiceError,
    all_pids,
    check_traversable,
    ensure_base_dir,
    kill_and_wait,
    make_dirs,
    pid_alive,
    proc_cmdline,
    proc_cwd,
    process_env,
    require_executables,
    run_command,
    service_account,
    tail,
    wait_ports_free,
    wait_until,
    which,
    write_file,
)

logger = logging.getLogger(__name__)

PG_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
PG_PACKAGE = "postgresql-15"
PG_USER = "postgres"
PG_DATABASE = "flowforge"
PG_MAX_CONNECTIONS = 200
PG_SHARED_BUFFERS = "32MB"
UNIX_SOCKET_PATH_MAX = 107  # bytes, sun_path minus the terminating NUL on Linux
PG_START_TIMEOUT_S = 60.0
PG_STOP_TIMEOUT_S = 30.0


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
        account = self.check_installed()
        if not self.is_running():
            self._clear_crash_leftovers(account)
            wait_ports_free({"PostgreSQL": self.port})
            self._prepare(account)
            self._write_config(account)
            self._pg_ctl(account, "start", "-l", str(self.log_file), timeout=PG_START_TIMEOUT_S)
        wait_until(self._accepts_connections, PG_START_TIMEOUT_S, f"{self!r} to accept connections")
        self._ensure_database()
        logger.info("postgres ready on port %s (pid %s)", self.port, self.pid)

    def stop(self) -> None:
        """Stop with ``pg_ctl stop -m fast`` (SIGKILL as fallback), bounded in time.

        Also kills processes left over from a killed postmaster. No-op if not running.
        """
        account = service_account(PG_USER, PG_PACKAGE)
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
            kill_and_wait(pid)
        if clean:
            self._clear_crash_leftovers(service_account(PG_USER, PG_PACKAGE))

    def restart(self) -> None:
        """``stop()`` then ``start()``."""
        self.stop()
        self.start()

    # -- internals --------------------------------------------------------------------

    def _binary(self, name: str) -> Path:
        return self.bin_dir / name

    def check_installed(self) -> Account:
        """Raise ServiceUnavailable if binaries or account are missing; return the account."""
        require_executables([self._binary(n) for n in ("initdb", "pg_ctl", "postgres")], PG_PACKAGE)
        return service_account(PG_USER, PG_PACKAGE)

    def _prepare(self, account: Account) -> None:
        """Create the private directories and run initdb if the cluster does not exist."""
        ensure_base_dir(self.base_dir)
        make_dirs(account, self.root, self.socket_dir)
        check_traversable(self.root, account)
        socket_path = self.socket_dir / f".s.PGSQL.{self.port}"
        if len(os.fsencode(socket_path)) > UNIX_SOCKET_PATH_MAX:
            raise ServiceError(f"socket path too long ({socket_path}); use a shorter base dir")
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(account)

    def _initdb(self, account: Account) -> None:
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
        run_command(argv, account, env=process_env({}), cwd=self.root, timeout=PG_START_TIMEOUT_S)
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude = 'flowforge.conf'\n")

    def _write_config(self, account: Account) -> None:
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
        write_file(self.data_dir / "flowforge.conf", "\n".join(settings) + "\n", account, 0o600)

    def _pg_ctl(self, account: Account, action: str, *args: str, timeout: float) -> None:
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
            run_command(argv, account, env=process_env({}), cwd=self.root, timeout=timeout + 5)
        except ServiceError as exc:
            raise ServiceError(f"{exc}; log: {tail(self.log_file)}") from None

    def _postmaster_pid(self) -> _PostmasterPid | None:
        try:
            return _parse_postmaster_pid((self.data_dir / "postmaster.pid").read_text())
        except OSError:
            return None

    def _is_our_postmaster(self, pid: int) -> bool:
        """True if ``pid`` is alive and runs in this data dir (postgres chdirs there)."""
        return pid_alive(pid) and proc_cwd(pid) == self.data_dir

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

    def _clear_crash_leftovers(self, account: Account) -> None:
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

    def _orphan_pids(self, account: Account) -> list[int]:
        """Live processes of ``account`` whose working directory is this data dir."""
        own = os.getpid()
        return [
            pid
            for pid in all_pids()
            if pid != own and proc_cwd(pid) == self.data_dir and _owner(pid) == account.uid
        ]

    def _stop_orphans(self, account: Account) -> None:
        """Give leftover backends ORPHAN_GRACE_S to exit, then SIGKILL them by pid."""
        try:
            wait_until(lambda: not self._orphan_pids(account), ORPHAN_GRACE_S, "orphans")
        except ServiceError:
            for pid in self._orphan_pids(account):
                logger.warning("SIGKILL leftover postgres process %s %s", pid, proc_cmdline(pid))
                kill_and_wait(pid)

    def _remove_stale_shm(self, info: _PostmasterPid, account: Account) -> None:
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
            ipcrm = which("ipcrm", "util-linux")
            run_command(
                [str(ipcrm), "-m", str(seg.shm_id)], account, env=process_env({}), cwd=self.root
            )


def _owner(pid: int) -> int | None:
    """The uid owning process ``pid`` (None if it is gone)."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None
