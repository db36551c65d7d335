"""The CLI's part of the store, opened for one command.

Commands that create runs go through the :class:`~flowforge.client.Client` (it knows the
workflows); the rest read and act through :class:`CliStatements`. Imported only by the commands
that use it, so ``--help``, ``validate`` and the others never load the database layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flowforge.config import Config
from flowforge.store.breakers import Gates
from flowforge.store.control import Control
from flowforge.store.db import Database
from flowforge.store.operator import Operator
from flowforge.store.processes import Processes


class CliStatements(Operator, Processes, Control, Gates):
    """Read models and the operator's actions (``Operator`` answers with ``Reads``, its base:
    ``runs``, ``dead``, ``stats``, ``purge``), the process registry (``ps``), breakers and
    pauses (``breakers``, ``pause``, ``resume``)."""


@contextmanager
def opened(config: Config) -> Iterator[CliStatements]:
    """The statements over a pool opened for the command and closed after it."""
    db = Database(config.database, application_name="flowforge-client")
    db.open()
    try:
        yield CliStatements(db)
    finally:
        db.close()
