"""The one way a part of the store runs SQL: a named query of ``queries.sql`` and its parameters.

Every store part (:mod:`~flowforge.store.triggers`, :mod:`~flowforge.store.passes`, ...) derives
from :class:`Part` and runs its statements through two helpers and nothing else:

- :meth:`Part._query` — one named statement as its own transaction (one round trip);
- :meth:`Part._transaction` — ``work(tx, *args)`` in one transaction, where ``tx`` (a
  :class:`Tx`) runs named statements on that transaction's cursor;
  :meth:`Part._pipelined` the same with the connection in pipeline mode, for a transaction on
  a latency path (a trigger, a publisher's sweep): statements whose results are not read
  (:meth:`Tx.send`) travel with the next one, ``BEGIN`` with the first and ``COMMIT`` with the
  last, so every round trip saved is one scheduling delay fewer on a busy host;
  :meth:`Part._pipelined_read` a read of several statements in one round trip, with no
  explicit transaction (:meth:`Tx.later` queues each, :meth:`Tx.sync` sends them).

The statements of :data:`PREPARED` are prepared server-side once per connection: each
execution skips parsing and analysis (a third of the server's CPU for a claim) and, once
PostgreSQL has found its generic plan no worse than five custom ones, planning too — kept only
while the tables are about the size it was made at (``store/plansize.py`` says why and how).
Every other statement is parsed and planned at each execution. docs/performance.md
("Submitting work"; "Several api processes and prepared statements"; "Generic plans at the
tables' size") has the measurements.

Both retry a deadlock or serialization failure (``Database.run`` / ``Database.execute``), a
transaction as a whole, so ``work`` must not have effects outside it that a retry would repeat
(a publisher's ``send`` is the exception its docstring states).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psycopg

from flowforge.store import queries
from flowforge.store.db import Cursor, Database, Pipelined, Row, run_statement

T = TypeVar("T")
#: The scheduler's pass (roles/scheduler.py ``run_pass``): what every pass runs, idle or not,
#: what a pass that propagates a finished task and settles its run adds, and what the loop asks
#: after a pass that found nothing (``next_due``, whose planning costs the server many times its
#: execution: docs/performance.md "The scheduler's idle loop").
PASSES = frozenset(
    {
        "next_due",
        "concurrency_keys_waiting",
        "expire_event_waits",
        "gate_work",
        "lock_child_starts",
        "lock_conditions",
        "lock_event_starts",
        "lock_expired_leases",
        "lock_failed",
        "lock_maps_to_expand",
        "lock_unpropagated",
        "open_item_slots",
        "overdue_runs",
        "promote_ready",
        "rate_keys_waiting",
        "settle_children",
        "settle_maps",
        "start_due_runs",
        "start_timers",
        "wake_timers",
        "mark_propagated",
        "runs_to_derive",
        "lock_runs",
        "run_facts",
        "update_run_states",
    }
)
#: Statements prepared server-side (module docstring), by name — the hot path's: the trigger's
#: inserts, the worker's claim and finish, the publisher's sweep, the api's read of a run; and
#: the scheduler's pass.
PREPARED = PASSES | frozenset(
    {
        "insert_runs",
        "insert_tasks",
        "insert_edges",
        "register_definitions",
        # the same inserts answering what they wrote (a POST's answer: "Submitting work, part 3")
        "insert_runs_answered",
        "insert_tasks_answered",
        "insert_edges_answered",
        "claim",
        "finish",
        "lock_outbox",
        "stamp_outbox",
        "get_run",
        "get_run_tasks",
        "run_children",
        "notify_new_tasks",
    }
)
#: Whether the libpq psycopg runs on has pipeline mode (14 and later; psycopg[binary] bundles
#: a recent one).
PIPELINES = psycopg.Pipeline.is_supported()
Params = Mapping[str, Any] | None


class Tx:
    """Named statements on one transaction's cursor.

    In a pipelined transaction (:meth:`Part._pipelined`) :meth:`all`, :meth:`one` and
    :meth:`count` sync the pipeline, so each is one round trip that carries every statement
    sent before it; :meth:`send` only queues its statement. Outside one, :meth:`send` runs it
    at once.
    """

    __slots__ = ("_cur", "_pipelined", "_queries")

    def __init__(
        self, cur: Cursor, named: Mapping[str, bytes], pipelined: Pipelined | None = None
    ) -> None:
        """``pipelined``: the pipeline's controls, in a pipelined transaction."""
        self._cur = cur
        self._queries = named
        self._pipelined = pipelined

    def all(self, name: str, params: Params = None) -> list[Row]:
        """Run ``name``; its rows (none for a statement that returns no rows)."""
        cur = self._run(name, params)
        return cur.fetchall() if cur.description is not None else []

    def one(self, name: str, params: Params = None) -> Row | None:
        """Run ``name``; its first row, or None."""
        cur = self._run(name, params)
        return cur.fetchone() if cur.description is not None else None

    def count(self, name: str, params: Params = None) -> int:
        """Run ``name``; the number of rows it changed."""
        return self._run(name, params).rowcount

    def send(self, name: str, params: Params = None) -> None:
        """Run ``name``, whose result is not needed. Pipelined, it goes with the next statement
        that syncs (or the commit), and an error of it is raised there."""
        self._execute(self._cur, name, params)

    def later(self, name: str, params: Params = None) -> Cursor:
        """Run ``name`` on a cursor of its own, whose rows are read after :meth:`sync`
        (pipelined: several such statements travel in one round trip; otherwise it runs now
        and ``sync`` does nothing)."""
        cur = self._cur.connection.cursor()
        self._execute(cur, name, params)
        return cur

    def sync(self) -> None:
        """Pipelined: send everything queued and read every result (an error of any of them
        is raised here); otherwise nothing."""
        if self._pipelined is not None:
            self._pipelined.sync()

    def notify(self, name: str, params: Params = None) -> None:
        """Run ``name``, a notification. Pipelined, it goes after the commit, in a transaction
        of its own (:meth:`Database.pipelined_transaction` says why): a notification that
        depends on what this transaction wrote reads it there, committed; otherwise it is part
        of this transaction."""
        if self._pipelined is None:
            self._execute(self._cur, name, params)
        else:
            self._pipelined.after_commit(self._queries[name], params, name in PREPARED)

    def _execute(self, cur: Cursor, name: str, params: Params) -> Cursor:
        return run_statement(cur, self._queries[name], params, name in PREPARED)

    def _run(self, name: str, params: Params) -> Cursor:
        cur = self._execute(self._cur, name, params)
        if self._pipelined is not None:
            self._pipelined.sync()  # its result (and an error of anything sent before it) is here
        return cur


class Part:
    """A store part over a :class:`Database`: its public methods each make one helper call.

    ``rand`` (a float in [0, 1)) feeds retry jitter in the scheduler passes; tests inject a
    fixed one.
    """

    def __init__(self, db: Database, rand: Callable[[], float] = random.random) -> None:
        self._db = db
        self._q = queries.load()
        self._rand = rand

    def _query(self, name: str, params: Params = None) -> list[Row]:
        """One named statement as its own transaction (one round trip); its rows, if any."""
        return self._db.execute(self._q[name], params, name in PREPARED)

    def _transaction(self, work: Callable[..., T], *args: Any) -> T:
        """``work(tx, *args)`` in one transaction, retried whole on a conflict."""
        named = self._q
        return self._db.run(lambda cur: work(Tx(cur, named), *args))

    def _pipelined(self, work: Callable[..., T], *args: Any) -> T:
        """As :meth:`_transaction`, with the connection in pipeline mode (module docstring);
        a plain transaction where libpq has no pipeline mode (before libpq 14)."""
        return self._in_pipeline(self._db.run_pipelined, work, *args)

    def _pipelined_read(self, work: Callable[..., T], *args: Any) -> T:
        """``work(tx, *args)``, a read, in pipeline mode with no explicit transaction
        (:meth:`Database.pipelined_reads`): what it queues with :meth:`Tx.later` goes in one
        round trip at its :meth:`Tx.sync`. A plain transaction without pipeline mode."""
        return self._in_pipeline(self._db.read_pipelined, work, *args)

    def _in_pipeline(
        self,
        scope: Callable[[Callable[[tuple[Cursor, Pipelined]], T]], T],
        work: Callable[..., T],
        *args: Any,
    ) -> T:
        """``work(tx, *args)`` through ``scope`` (one of the Database's pipelined runners)."""
        if not PIPELINES:
            return self._transaction(work, *args)
        named = self._q

        def pipelined(controls: tuple[Cursor, Pipelined]) -> T:
            cur, pipeline = controls
            return work(Tx(cur, named, pipeline), *args)

        return scope(pipelined)
