"""The one way a part of the store runs SQL: a named query of ``queries.sql`` and its parameters.

Every store part (:mod:`~flowforge.store.triggers`, :mod:`~flowforge.store.passes`, ...) derives
from :class:`Part` and runs its statements through two helpers and nothing else:

- :meth:`Part._query` — one named statement as its own transaction (one round trip);
- :meth:`Part._transaction` — ``work(tx, *args)`` in one transaction, where ``tx`` (a
  :class:`Tx`) runs named statements on that transaction's cursor.

Both retry a deadlock or serialization failure (``Database.run`` / ``Database.execute``), a
transaction as a whole, so ``work`` must not have effects outside it that a retry would repeat
(a publisher's ``send`` is the exception its docstring states).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from flowforge.store import queries
from flowforge.store.db import Cursor, Database, Row

T = TypeVar("T")
Params = Mapping[str, Any] | None


class Tx:
    """Named statements on one transaction's cursor."""

    __slots__ = ("_cur", "_queries")

    def __init__(self, cur: Cursor, named: Mapping[str, bytes]) -> None:
        self._cur = cur
        self._queries = named

    def all(self, name: str, params: Params = None) -> list[Row]:
        """Run ``name``; its rows (none for a statement that returns no rows)."""
        cur = self._cur.execute(self._queries[name], params)
        return cur.fetchall() if cur.description is not None else []

    def one(self, name: str, params: Params = None) -> Row | None:
        """Run ``name``; its first row, or None."""
        cur = self._cur.execute(self._queries[name], params)
        return cur.fetchone() if cur.description is not None else None

    def count(self, name: str, params: Params = None) -> int:
        """Run ``name``; the number of rows it changed."""
        return self._cur.execute(self._queries[name], params).rowcount


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
        return self._db.execute(self._q[name], params)

    def _transaction(self, work: Callable[..., T], *args: Any) -> T:
        """``work(tx, *args)`` in one transaction, retried whole on a conflict."""
        named = self._q
        return self._db.run(lambda cur: work(Tx(cur, named), *args))
