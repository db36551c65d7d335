"""PostgreSQL connections: a pool opened after fork, and error translation at the boundary.

:class:`Database` does nothing in its constructor; :meth:`Database.open` creates the pool, so
a role object can be built in the supervisor and opened in the child. Every session gets
``statement_timeout`` and ``idle_in_transaction_session_timeout`` so the server cleans up after
a process killed in the middle of a transaction.

Retries: a transaction PostgreSQL rolled back for a conflict (a deadlock, a serialization
failure) is run again here, whole, and by nothing above; an outage is never retried here — it
is raised once, and the level that owns the statement decides (the worker's ledger for its
finish, ``run_role`` for every other statement of a role, the caller for the API and the CLI;
``flowforge/roles/runner.py``, "Who retries a failed statement").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from flowforge.config import DatabaseConfig
from flowforge.errors import (
    DatabaseConfigError,
    DatabaseUnavailableError,
    FlowForgeError,
    StoreError,
    TransactionConflictError,
)
from flowforge.store import queries
from flowforge.store.pgerrors import check_url, translate, translate_errors
from flowforge.store.plansize import PlanSizes

__all__ = ["Database", "connect_once", "session_options", "translate_errors"]

logger = logging.getLogger(__name__)

Row = dict[str, Any]
T = TypeVar("T")
Cursor = psycopg.Cursor[Row]

#: Runs of a transaction that keeps meeting conflicts before the conflict is raised.
TRANSACTION_ATTEMPTS = 5

#: psycopg's ``prepare_threshold``: a count of executions no statement reaches, so only those
#: executed with ``prepare=True`` are prepared (None would refuse those too).
NEVER_BY_COUNT = 2**62

#: Makes the pool (:class:`LifoPool`; a seam: unit tests count attempts on a fake pool).
PoolFactory = Callable[..., ConnectionPool[psycopg.Connection[Row]]]


class LifoPool(ConnectionPool[psycopg.Connection[Row]]):
    """psycopg_pool's pool, handing out the connection returned last (psycopg_pool hands them
    out in turn, the oldest returned first, and has no option for this order).

    In turn, a process that uses one connection at a time still spreads its statements over
    every connection the pool ever opened — each with its own session: its own catalog
    caches, its own five custom plans of every prepared statement after a drain
    (store/plansize.py), and never idle long enough for ``max_idle`` to close it. Last in,
    first out, the hot connection serves and the others wait, idle, at the other end of the
    queue, which is the end the pool's shrinking closes first (docs/performance.md, "The pool
    hands out the connection returned last"). The order lives in psycopg_pool's private
    ``_pool`` deque (psycopg-pool pinned in constraints.txt); should a release rename it, the
    pool is left in its own order, and tests/integration/test_pool_order.py fails."""

    def _get_ready_connection(self, timeout: float | None) -> psycopg.Connection[Row] | None:
        ready = getattr(self, "_pool", None)  # under the pool's lock, as getconn calls this
        if ready:
            ready.rotate(1)  # the last returned first; the rest keep their order
        return super()._get_ready_connection(timeout)


def session_options(config: DatabaseConfig) -> str:
    """libpq ``options`` that make the server clean up after a killed client, and no JIT
    compilation: every statement here is short, and the planner's estimates for the admission
    pass over a map's 10,000 waiting items cross ``jit_above_cost``, where compiling costs
    several times what running does (docs/performance.md, "A map's items under limits").

    ``plan_cache_mode`` is left to the server (``auto`` unless an operator set it for the role
    or database): a prepared statement (store/part.py ``PREPARED``) may then run its generic
    plan, which :class:`~flowforge.store.plansize.PlanSizes` keeps to the tables' size, and
    ``force_custom_plan`` for FlowForge's role turns that off (docs/operations.md)."""
    return (
        f"-c statement_timeout={config.statement_timeout_ms} "
        f"-c idle_in_transaction_session_timeout={config.idle_in_transaction_timeout_ms} "
        "-c jit=off"
    )


@contextmanager
def connect_once(url: str, connect_timeout_s: float = 5.0) -> Iterator[psycopg.Connection[Any]]:
    """A single autocommit connection for one-off work (migrations, CLI checks)."""
    check_url(url)
    with translate_errors(url):
        conn = psycopg.connect(url, autocommit=True, connect_timeout=_timeout(connect_timeout_s))
    try:
        with translate_errors(url):
            yield conn
    finally:
        conn.close()


class Database:
    """A connection pool whose statements run once, but for a conflict (see module docstring)."""

    def __init__(
        self,
        config: DatabaseConfig,
        application_name: str = "flowforge",
        *,
        pool_factory: PoolFactory = LifoPool,
        connect: Callable[..., Any] = psycopg.connect,
        plan_sizes: PlanSizes | None = None,
    ) -> None:
        """``pool_factory`` and ``connect`` (one connection outside the pool) are seams for
        tests; production uses :class:`LifoPool` (psycopg_pool's) and psycopg.connect.
        ``plan_sizes``: what keeps each connection's generic plans to the tables' size (a seam
        for a test's clock)."""
        self._config = config
        self._application_name = application_name
        self._pool_factory = pool_factory
        self._connect = connect
        self._pool: ConnectionPool[psycopg.Connection[Row]] | None = None
        self._plans = plan_sizes or PlanSizes()
        self._checked = False  # the server has not refused this configuration (first open)

    @property
    def config(self) -> DatabaseConfig:
        return self._config

    def open(self) -> None:
        """Create the pool. Call after fork: a pool never crosses a process boundary.

        The first open makes one direct connection first, so a server that refuses this
        configuration (TLS, authentication, no such database: :class:`DatabaseConfigError`) is
        reported at once, at boot, rather than after the pool's ``connect_timeout_s`` of
        retries. An outage is left to the pool, as before: the api keeps serving (503s) through
        one. Later opens (a role reconnecting) go straight to the pool.
        """
        if self._pool is not None:
            return
        check_url(self._config.url)
        if not self._checked:
            refusal = self._connect_directly()
            if isinstance(refusal, DatabaseConfigError):
                raise refusal
            self._checked = True
        self._start_pool()

    def _start_pool(self) -> None:
        self._pool = self._pool_factory(
            self._config.url,
            min_size=self._config.pool_min,
            max_size=self._config.pool_max,
            kwargs={
                # single statements run as their own transaction (one round trip); multi-
                # statement work opens an explicit transaction block
                "autocommit": True,
                "row_factory": dict_row,
                "application_name": self._application_name,
                "options": session_options(self._config),
                "connect_timeout": _timeout(self._config.connect_timeout_s),
                # never prepared server-side by count: only the statements a caller asks for
                # (``prepare=True``: store/part.py PREPARED), whose generic plans the tables'
                # size classes are watched for (store/plansize.py), so the threshold is one no
                # statement reaches
                "prepare_threshold": NEVER_BY_COUNT,
            },
            timeout=self._config.connect_timeout_s,
            open=False,
            name=self._application_name,
        )
        self._pool.open(wait=False)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=1.0)

    def reset(self) -> None:
        """Drop every pooled connection (after an outage) and open a fresh pool; never raises
        for the server (no direct connection: callers are recovering from a failure).

        A fresh pool connects at once; the old one would refill in the background on
        psycopg_pool's own backoff, which the next attempt of the caller's retry should not
        wait for."""
        self.close()
        check_url(self._config.url)
        self._start_pool()

    @contextmanager
    def transaction(self) -> Iterator[Cursor]:
        """One transaction on a pooled connection; commits on success, rolls back on error.

        Connection-level failures surface as :class:`DatabaseUnavailableError`, not retried.
        The pool checks a connection that failed and discards it, so the next call reconnects.
        """
        if self._pool is None:
            raise StoreError("database pool is not open")
        with (
            translate_errors(self._config.url, self._diagnose),
            self._connection() as conn,
            conn.transaction(),
            conn.cursor() as cur,
        ):
            yield cur

    @contextmanager
    def pipelined_transaction(self) -> Iterator[tuple[Cursor, Pipelined]]:
        """As :meth:`transaction`, with the connection in pipeline mode: a statement executed
        is only queued, and its result is there once ``sync()`` (of the :class:`Pipelined`
        yielded with the cursor) has sent everything queued and read every result — one round
        trip for all of them. The ``BEGIN`` goes with the first sync and the ``COMMIT`` with
        whatever is still queued at the end, so a transaction of n statements whose results
        are read costs n round trips rather than n + 2 (psycopg's own
        ``Connection.transaction`` syncs after each of them). An error is raised at the sync
        after the statement that failed (at the latest, at the commit); the transaction is
        then rolled back.

        ``after_commit(query, params, prepare=False)``: a notification (a ``pg_notify``, which
        may read what the transaction wrote to decide whether to notify) sent after the
        ``COMMIT``, in the same round trip, as a transaction of its own. A commit that
        notifies holds PostgreSQL's one notify lock (for the whole cluster) through its WAL
        flush, so such commits queue behind each other's flushes; a transaction that only
        notifies writes no WAL and holds it for microseconds. Listeners hear it after the
        commit either way. Should it fail once the transaction committed (the notify queue
        full), that is logged and not raised: the work is done, and listeners poll.
        ``prepare`` prepares it server-side, as ``cursor.execute``'s argument does.
        """
        if self._pool is None:
            raise StoreError("database pool is not open")
        with (
            translate_errors(self._config.url, self._diagnose),
            self._connection() as conn,
            _pipelined(conn) as pipelined,
            conn.cursor() as cur,
        ):
            yield cur, pipelined

    @contextmanager
    def pipelined_reads(self) -> Iterator[tuple[Cursor, Pipelined]]:
        """A connection in pipeline mode with no explicit transaction, for a read of several
        statements: those executed before the first ``sync()`` go in one round trip, as one
        implicit transaction (read committed, as :meth:`transaction`'s, with no ``BEGIN`` or
        ``COMMIT`` of its own), and ``sync()`` leaves pipeline mode, so a statement after it
        runs on its own. ``after_commit`` is not for these (it raises)."""
        if self._pool is None:
            raise StoreError("database pool is not open")

        def no_commit(_query: bytes, _params: Mapping[str, Any] | None = None) -> None:
            raise StoreError("a pipelined read commits nothing to notify after")

        with (
            translate_errors(self._config.url, self._diagnose),
            self._connection() as conn,
            conn.cursor() as cur,
        ):
            # leaving pipeline mode sends its Sync: one sync is the one round trip, not two
            pipeline = conn.pipeline()
            entered = pipeline.__enter__()
            left = False

            def sync() -> None:
                nonlocal left
                if not left:
                    left = True
                    pipeline.__exit__(None, None, None)

            try:
                yield cur, Pipelined(sync, no_commit)
            except BaseException as exc:
                if not left:
                    left = True
                    if isinstance(exc, psycopg.Error):
                        _settle(entered)
                    pipeline.__exit__(type(exc), exc, exc.__traceback__)
                raise
            sync()

    def execute(
        self, query: bytes, params: Mapping[str, Any] | None = None, prepare: bool = False
    ) -> list[Row]:
        """One statement as its own transaction (one round trip); returns its rows, if any.
        ``prepare``: prepared server-side on its connection (parsed once; planned for its
        values each time: :func:`session_options`).

        Deadlocks and serialization failures are retried like :meth:`run`; nothing else is.
        """

        def one(cur: Cursor) -> list[Row]:
            ran = run_statement(cur, query, params, prepare)
            return ran.fetchall() if ran.description is not None else []

        return self._retrying(self._statement, one)

    @contextmanager
    def _statement(self) -> Iterator[Cursor]:
        if self._pool is None:
            raise StoreError("database pool is not open")
        with (
            translate_errors(self._config.url, self._diagnose),
            self._connection() as conn,
            conn.cursor() as cur,
        ):
            yield cur

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Row]]:
        """A pooled connection. When the tables' size class changed (store/plansize.py) the
        pool is drained: every connection, this one once it is back, is replaced by a new
        session that plans at the tables' size."""
        assert self._pool is not None
        with self._pool.connection() as conn:
            if self._plans.changed(conn):
                self._pool.drain()
            yield conn

    def _diagnose(self) -> FlowForgeError:
        """Why the pool gave no connection in time: psycopg_pool's ``PoolTimeout`` hides it.

        One direct attempt with the pool's URL names the cause (refused, no such database,
        authentication failed, ...). If that attempt succeeds, the server is fine and every
        pooled connection stayed busy for the whole wait.
        """
        return self._connect_directly() or DatabaseUnavailableError(
            f"database busy: all {self._config.pool_max} pooled connection(s) stayed in use "
            f"for {self._config.connect_timeout_s:g} s"
        )

    def _connect_directly(self) -> FlowForgeError | None:
        """Connect once with the pool's URL and settings, outside the pool; what went wrong,
        translated, or None."""
        try:
            self._connect(
                self._config.url,
                connect_timeout=_timeout(self._config.connect_timeout_s),
                application_name=self._application_name,
            ).close()
        except (psycopg.Error, UnicodeEncodeError) as exc:
            return translate(exc, self._config.url)
        return None

    def run(self, work: Callable[..., T], *args: Any) -> T:
        """Run ``work(cursor, *args)`` in a transaction; a conflict runs it again, whole, in a
        new transaction, up to :data:`TRANSACTION_ATTEMPTS` runs (``work`` must have no effect
        outside the transaction that a second run would repeat). Nothing else is retried."""
        return self._retrying(self.transaction, work, *args)

    def read_pipelined(self, work: Callable[..., T], *args: Any) -> T:
        """``work((cursor, pipelined), *args)`` in :meth:`pipelined_reads`; retried as
        :meth:`run` is (a read meets no conflict, but a deadlock would be retried the same)."""
        return self._retrying(self.pipelined_reads, work, *args)

    def run_pipelined(self, work: Callable[..., T], *args: Any) -> T:
        """As :meth:`run`, in a :meth:`pipelined_transaction`:
        ``work((cursor, pipelined), *args)``."""
        return self._retrying(self.pipelined_transaction, work, *args)

    def _retrying(self, scope: Callable[[], Any], work: Callable[..., T], *args: Any) -> T:
        """``work`` in ``scope``, run again at once after a conflict: PostgreSQL rolled the
        transaction back, so nothing of it took effect, and a deadlock was already waited out
        (``deadlock_timeout``) before it was reported."""
        for attempt in range(1, TRANSACTION_ATTEMPTS + 1):
            try:
                with scope() as cur:
                    return work(cur, *args)
            except TransactionConflictError:
                if attempt == TRANSACTION_ATTEMPTS:
                    raise
                logger.debug("transaction retried after a conflict", extra={"action": "tx_retry"})
        raise AssertionError("unreachable")


def run_statement(
    cur: Cursor, query: bytes, params: Mapping[str, Any] | None, prepare: bool = False
) -> Cursor:
    """Execute ``query`` (named ``%(name)s`` placeholders) with ``params`` on ``cur``'s
    connection; the cursor that ran it. A statement longer than psycopg parses once
    (:data:`~flowforge.store.queries.PARSE_CACHED_BYTES`) goes through a ``RawCursor`` of the
    same connection with PostgreSQL's ``$n`` placeholders, converted once per process
    (:func:`~flowforge.store.queries.numbered`): psycopg would parse it again at every
    execution (docs/performance.md, "A finish settles a one-task run")."""
    if params is not None and len(query) > queries.PARSE_CACHED_BYTES:
        text, names = queries.numbered(query)
        cur = psycopg.RawCursor(cur.connection, row_factory=dict_row)
        query, params = text, [params[name] for name in names]  # type: ignore[assignment]
    # (psycopg's own default when not prepared: the pool's threshold prepares nothing by count)
    return cur.execute(query, params, prepare=True) if prepare else cur.execute(query, params)


@dataclass(frozen=True)
class Pipelined:
    """A pipelined transaction's controls (see :meth:`Database.pipelined_transaction`)."""

    sync: Callable[[], None]
    after_commit: Callable[..., None]


@contextmanager
def _pipelined(conn: psycopg.Connection[Row]) -> Iterator[Pipelined]:
    """A transaction in pipeline mode on an autocommit connection (see
    :meth:`Database.pipelined_transaction`), rolled back if anything raises before it
    committed."""
    after: list[tuple[bytes, Mapping[str, Any] | None, bool]] = []

    def after_commit(
        query: bytes, params: Mapping[str, Any] | None = None, prepare: bool = False
    ) -> None:
        after.append((query, params, prepare))

    commit = conn.cursor()
    try:
        with conn.pipeline() as pipeline:
            try:
                conn.execute(b"BEGIN")
                yield Pipelined(pipeline.sync, after_commit)
                commit.execute(b"COMMIT")
                for query, params, prepare in after:
                    conn.execute(query, params, prepare=prepare)
            except psycopg.Error:
                _settle(pipeline)
                raise
    except psycopg.Error:
        if after and commit.statusmessage == "COMMIT":
            logger.warning(
                "a notification after a commit failed; its listeners find the work when they poll",
                exc_info=True,
                extra={"action": "notify_failed"},
            )
            return
        _roll_back(conn)
        raise
    except BaseException:
        _roll_back(conn)
        raise


def _settle(pipeline: psycopg.Pipeline) -> None:
    """End the aborted stretch a failed statement left in ``pipeline`` (one more ``Sync``), so
    that leaving the pipeline with the error does not fail again: psycopg would log that second
    failure as a warning ("error ignored terminating ... pipeline aborted") although the error
    itself is raised and handled. A connection that broke raises here too: the error raised is
    the first one."""
    try:
        pipeline.sync()
    except psycopg.Error:
        logger.debug("a pipeline's sync after its failed statement failed", exc_info=True)


def _roll_back(conn: psycopg.Connection[Row]) -> None:
    if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
        try:
            conn.rollback()
        except psycopg.Error:  # a broken connection: the pool discards it
            logger.debug("rollback after a failed pipelined transaction failed", exc_info=True)


def _timeout(seconds: float) -> int:
    """libpq's ``connect_timeout``: whole seconds, at least 1."""
    return max(1, int(seconds))
