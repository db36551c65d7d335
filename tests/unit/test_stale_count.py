"""A finish that committed is reported even when counting its stale outcomes fails
(store/claims.py ``Claims._count_stale``): raising would make the worker send the committed
finish again, every outcome of it then stale."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from flowforge.domain.model import Finish
from flowforge.domain.states import TaskState
from flowforge.errors import DatabaseUnavailableError
from flowforge.store.claims import Claims


class Db:
    """Answers ``finish`` with one committed task of two; the stale count fails."""

    def __init__(self, committed: uuid.UUID) -> None:
        self.committed = committed
        self.ran: list[bytes] = []

    def execute(self, query: bytes, params: Any = None, prepare: bool = False) -> list[Any]:
        self.ran.append(query)
        if b"INSERT INTO counters" in query:
            raise DatabaseUnavailableError("the database went away")
        return [{"id": self.committed, "ready_token": None, "queued": 0, "published": 0}]


def test_a_committed_finish_survives_a_failed_stale_count(caplog: pytest.LogCaptureFixture) -> None:
    done, stale = uuid.uuid4(), uuid.uuid4()
    db = Db(done)
    ok = Finish(TaskState.SUCCEEDED, {})
    with caplog.at_level(logging.WARNING):
        finished = Claims(db).finish_many([(done, 1, ok), (stale, 1, ok)])  # type: ignore[arg-type]
    assert finished.committed == frozenset({done})
    assert len(db.ran) == 2  # the finish, then the count that failed
    assert any(getattr(r, "action", None) == "stale_count_failed" for r in caplog.records)


def test_a_finish_with_nothing_stale_counts_nothing() -> None:
    done = uuid.uuid4()
    db = Db(done)
    finished = Claims(db).finish_many([(done, 1, Finish(TaskState.SUCCEEDED, {}))])  # type: ignore[arg-type]
    assert finished.committed == frozenset({done}) and len(db.ran) == 1
