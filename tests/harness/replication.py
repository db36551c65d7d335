"""A private PostgreSQL 15 primary plus one synchronous streaming replica, for failover tests.

Both nodes are :class:`~tests.harness.services.PrivatePostgres` instances under one base
directory of their own (``base_dir/pg-repl-<primary>-<replica>/pg-<port>/``), listening on
127.0.0.1 only, run as the ``postgres`` account when invoked as root, and addressed by the
pids their own postmaster.pid files record; the machine's shared servers are never touched.

How the pair is built (about 2 s here, see :meth:`PrivateReplicatedPostgres.start`):

1. node 0 is initialised and started as the primary (``wal_level = replica``, wal senders and
   slots; initdb's pg_hba.conf already trusts ``replication`` connections from 127.0.0.1);
2. node 1 is cloned from it with ``pg_basebackup -R -X stream -C -S <slot>``: a standby that
   streams through a physical slot, its walreceiver named ``application_name = ff_replica``;
3. once ``pg_stat_replication`` shows it streaming, the primary gets
   ``synchronous_standby_names = 'ff_replica'`` (``ALTER SYSTEM`` + reload, so only the
   primary's ``postgresql.auto.conf`` has it), and the build waits for ``sync_state = 'sync'``.
   Setting it earlier would block every commit on the primary until the standby connects.

From then on a commit acknowledged by the primary is flushed on the replica too, so after
:meth:`~PrivateReplicatedPostgres.kill_primary` and
:meth:`~PrivateReplicatedPostgres.promote_replica` no acknowledged commit is lost. The promoted
node has no ``synchronous_standby_names`` (it was cloned before they were set), so it accepts
writes alone. :attr:`~PrivateReplicatedPostgres.url` is a libpq multi-host URL with
``target_session_attrs=read-write``: it reaches whichever node is the primary, and fails while
there is none (between the kill and the promotion).

There is no re-joining of the old primary: :meth:`~PrivateReplicatedPostgres.start` on a pair
that is not a healthy "node 0 primary, node 1 sync standby" discards both data directories and
builds a fresh pair. Not thread-safe.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import psycopg
from psycopg import sql

from flowforge.devservices.postgres import (
    PG_BIN_DIR,
    PG_DATABASE,
    PG_PACKAGE,
    PG_USER,
    PrivatePostgres,
)
from flowforge.devservices.procs import (
    CONNECT_TIMEOUT_S,
    LOOPBACK,
    Account,
    ServiceError,
    ensure_base_dir,
    make_dirs,
    process_env,
    require_executables,
    run_command,
    service_account,
    wait_until,
)

logger = logging.getLogger(__name__)

#: ``application_name`` of the replica's walreceiver, named in ``synchronous_standby_names``.
STANDBY_NAME = "ff_replica"
#: Physical replication slot on the primary that the replica streams from.
SLOT_NAME = "ff_replica_slot"
#: flowforge.conf lines of both nodes (a standby needs the same values as its primary).
REPLICATION_SETTINGS = (
    "wal_level = replica",
    "max_wal_senders = 4",
    "max_replication_slots = 4",
    "hot_standby = on",
    "wal_receiver_status_interval = '1s'",
)

# --- timeouts (seconds) ----------------------------------------------------------------
BASEBACKUP_TIMEOUT_S = 60.0
REPLICATION_TIMEOUT_S = 30.0
PROMOTE_TIMEOUT_S = 30.0


class PrivateReplicatedPostgres:
    """Node 0 (``primary_port``) as primary, node 1 (``replica_port``) as its sync standby.

    ``nodes[i]`` are the two :class:`PrivatePostgres` instances (index 0 is always the node
    built as primary, whichever is read-write now: see :meth:`primary_index`).
    """

    def __init__(
        self, base_dir: Path, primary_port: int, replica_port: int, *, bin_dir: Path = PG_BIN_DIR
    ) -> None:
        """Describe the pair; nothing is created or started until ``start()``.

        ``base_dir`` must exist and be searchable by the ``postgres`` account (mode 0755).
        """
        self.base_dir = Path(base_dir).absolute()
        self.bin_dir = bin_dir
        self.root = self.base_dir / f"pg-repl-{primary_port}-{replica_port}"
        self.nodes = tuple(
            PrivatePostgres(self.root, port, bin_dir=bin_dir, extra_settings=REPLICATION_SETTINGS)
            for port in (primary_port, replica_port)
        )

    def __repr__(self) -> str:
        ports = [node.port for node in self.nodes]
        return f"PrivateReplicatedPostgres(ports={ports}, root={str(self.root)!r})"

    # -- URLs -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Multi-host URL of database ``flowforge`` that connects to the read-write node only."""
        hosts = ",".join(f"{LOOPBACK}:{node.port}" for node in self.nodes)
        return (
            f"postgresql://{PG_USER}@{hosts}/{PG_DATABASE}"
            f"?target_session_attrs=read-write&connect_timeout={int(CONNECT_TIMEOUT_S)}"
        )

    def server_url(self, index: int) -> str:
        """URL of database ``flowforge`` on node ``index`` alone (whatever its role)."""
        return self.nodes[index].url

    def admin_url(self, index: int) -> str:
        """URL of the ``postgres`` maintenance database on node ``index``."""
        return self.nodes[index].admin_url

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        """Make the pair run: node 0 primary, node 1 streaming standby with sync_state 'sync'.

        A no-op if that is already the case; otherwise whatever runs is stopped, the pair's
        directory is discarded and a fresh pair is built (initdb, pg_basebackup), all data
        lost. Raises ServiceUnavailable if PostgreSQL 15 is not installed, ServiceError if
        a step fails or a wait (each bounded) times out.
        """
        account = self._check_prerequisites()
        if self._healthy():
            return
        started = time.monotonic()
        self.stop()
        if self.root.exists():
            logger.info("discarding previous pair under %s", self.root)
            shutil.rmtree(self.root)
        ensure_base_dir(self.base_dir)
        primary, replica = self.nodes
        primary.start()
        self._base_backup(account)
        replica.start()
        wait_until(
            lambda: self._standby_state() in (("streaming", "async"), ("streaming", "sync")),
            REPLICATION_TIMEOUT_S,
            f"{STANDBY_NAME} to stream from port {primary.port}",
        )
        with psycopg.connect(primary.admin_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                    sql.Literal(STANDBY_NAME)
                )
            )
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            conn.execute("SELECT pg_reload_conf()")
        wait_until(
            lambda: self._standby_state() == ("streaming", "sync"),
            REPLICATION_TIMEOUT_S,
            f"{STANDBY_NAME} to become a synchronous standby",
        )
        logger.info("replicated pair %s built in %.1f s", self, time.monotonic() - started)

    def stop(self) -> None:
        """Stop both nodes (whichever run) and clear crash leftovers; idempotent.

        Both are attempted; the first error is raised afterwards. The data is kept.
        """
        errors: list[Exception] = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- failover ---------------------------------------------------------------------

    def primary_index(self) -> int:
        """Index of the running node that is not in recovery; ServiceError if there is none."""
        for index, node in enumerate(self.nodes):
            if node.is_running() and self._in_recovery(index) is False:
                return index
        raise ServiceError(f"{self!r} has no read-write node")

    def kill_primary(self) -> int:
        """SIGKILL the current primary's postmaster and clean up after it; return its index.

        Waits until its orphaned backends are gone, then removes its SysV shared-memory
        segment, socket lock and postmaster.pid (it is not meant to be started again).
        """
        index = self.primary_index()
        started = time.monotonic()
        self.nodes[index].kill(clean=True)
        logger.info("killed primary node %s in %.2f s", index, time.monotonic() - started)
        return index

    def promote_replica(self) -> int:
        """Promote the running standby and wait until it accepts writes; return its index.

        Uses ``pg_promote(wait => true)``; ServiceError if no node is a running standby or
        the promotion does not finish within PROMOTE_TIMEOUT_S.
        """
        standbys = [
            i for i, node in enumerate(self.nodes) if node.is_running() and self._in_recovery(i)
        ]
        if not standbys:
            raise ServiceError(f"{self!r} has no running standby to promote")
        index = standbys[0]
        started = time.monotonic()
        with psycopg.connect(self.admin_url(index), autocommit=True) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (int(PROMOTE_TIMEOUT_S),)).fetchone()
        if row is None or row[0] is not True:
            raise ServiceError(f"node {index} did not finish promotion in {PROMOTE_TIMEOUT_S} s")
        wait_until(
            lambda: self._accepts_writes(index),
            PROMOTE_TIMEOUT_S,
            f"promoted node {index} to accept read-write sessions",
        )
        logger.info("promoted node %s in %.2f s", index, time.monotonic() - started)
        return index

    # -- internals --------------------------------------------------------------------

    def _check_prerequisites(self) -> Account:
        """Raise ServiceUnavailable if binaries or the account are missing; return it."""
        names = ("initdb", "pg_ctl", "postgres", "pg_basebackup")
        require_executables([self.bin_dir / name for name in names], PG_PACKAGE)
        return service_account(PG_USER, PG_PACKAGE)

    def _base_backup(self, account: Account) -> None:
        """Clone node 0 into node 1's (absent) data dir as a standby with slot and conninfo.

        ``-R`` writes standby.signal plus primary_conninfo (with our application_name) and
        primary_slot_name to postgresql.auto.conf; flowforge.conf is copied too and rewritten
        with node 1's port when node 1 starts. ``-c fast`` avoids waiting for a spread
        checkpoint.
        """
        primary, replica = self.nodes
        make_dirs(account, replica.root, replica.socket_dir)
        conninfo = (
            f"host={LOOPBACK} port={primary.port} user={PG_USER} application_name={STANDBY_NAME}"
        )
        argv: list[str | Path] = [
            self.bin_dir / "pg_basebackup",
            "-D",
            replica.data_dir,
            "-d",
            conninfo,
            "-R",
            "-X",
            "stream",
            "-C",
            "-S",
            SLOT_NAME,
            "-c",
            "fast",
            "--no-sync",
            "--no-password",
        ]
        started = time.monotonic()
        run_command(
            argv, account, env=process_env({}), cwd=replica.root, timeout=BASEBACKUP_TIMEOUT_S
        )
        logger.info("pg_basebackup took %.2f s", time.monotonic() - started)

    def _standby_state(self) -> tuple[str, str] | None:
        """(state, sync_state) of our standby in node 0's pg_stat_replication, if listed."""
        try:
            with psycopg.connect(self.admin_url(0), connect_timeout=int(CONNECT_TIMEOUT_S)) as conn:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY_NAME,),
                ).fetchone()
        except psycopg.OperationalError:
            return None
        return (str(row[0]), str(row[1])) if row is not None else None

    def _in_recovery(self, index: int) -> bool | None:
        """``pg_is_in_recovery()`` on node ``index``; None if it cannot be reached."""
        try:
            with psycopg.connect(
                self.admin_url(index), connect_timeout=int(CONNECT_TIMEOUT_S)
            ) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.OperationalError:
            return None
        return bool(row[0]) if row is not None else None

    def _accepts_writes(self, index: int) -> bool:
        """True if node ``index`` accepts a ``target_session_attrs=read-write`` session."""
        try:
            with psycopg.connect(
                self.admin_url(index),
                connect_timeout=int(CONNECT_TIMEOUT_S),
                target_session_attrs="read-write",
            ):
                return True
        except psycopg.OperationalError:
            return False

    def _healthy(self) -> bool:
        """True if both nodes run, node 0 is read-write and node 1 streams synchronously."""
        return (
            all(node.is_running() for node in self.nodes)
            and self._in_recovery(0) is False
            and self._in_recovery(1) is True
            and self._standby_state() == ("streaming", "sync")
        )
