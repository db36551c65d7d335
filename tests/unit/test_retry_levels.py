"""A failed statement is retried at one level only (``flowforge/roles/runner.py``, "Who
retries a failed statement"), proven by counting attempts at each level:

- :class:`~flowforge.store.db.Database` over a fake pool: a conflict runs the transaction
  again, whole; an outage is tried once and raised;
- the worker's real loop under :func:`~flowforge.roles.runner.run_role`, over
  :class:`tests.stubs.StubBroker` and :class:`tests.stubs.FakeStore`: an outage of the finish is
  retried by the ledger (``run_role`` never sees it), an outage of the claim by ``run_role``
  (the ledger does not retry it), and a conflict the ``Database`` gave up on by no one.

The same outages against real PostgreSQL restarts: tests/chaos/test_service_restarts.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from flowforge.config import DatabaseConfig
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.states import TaskState
from flowforge.errors import (
    BrokerUnavailableError,
    DatabaseUnavailableError,
    FlowForgeError,
    TransactionConflictError,
)
from flowforge.roles.runner import run_role
from flowforge.store.db import TRANSACTION_ATTEMPTS, Database
from flowforge.store.plansize import PlanSizes
from tests.unit.test_worker_loop import Rig, make_rig

NO_WAIT = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
URL = "postgresql://flowforge@127.0.0.1:5432/flowforge"
Rows = list[dict[str, Any]]


def deadlock() -> Exception:
    return pg_errors.DeadlockDetected("deadlock detected")


def outage() -> Exception:
    return psycopg.OperationalError(
        'connection to server at "127.0.0.1", port 5432 failed: Connection refused'
    )


class FakePool:
    """psycopg_pool's ``ConnectionPool`` as ``Database`` uses it: each statement executed
    takes the next of ``script`` (rows to return, or an exception to raise) and is counted, as
    are the transactions begun and rolled back."""

    def __init__(self, script: list[Rows | Exception]) -> None:
        self.script = script
        self.executed = 0
        self.begun = 0
        self.rolled_back = 0

    def __call__(self, conninfo: str, **kwargs: Any) -> FakePool:  # the pool factory
        return self

    def connect(self, conninfo: str, **kwargs: Any) -> FakePool:  # one connection outside it
        return self

    def open(self, wait: bool = True) -> None:
        pass

    def close(self, timeout: float = 5.0) -> None:
        pass

    @contextmanager
    def connection(self) -> Iterator[FakePool]:
        yield self

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.begun += 1
        try:
            yield
        except BaseException:
            self.rolled_back += 1
            raise

    @contextmanager
    def cursor(self) -> Iterator[FakePool]:
        yield self

    def execute(self, query: bytes, params: object = None, prepare: bool | None = None) -> FakePool:
        self.executed += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        self._rows = step
        return self

    @property
    def description(self) -> object:
        return ["n"]

    def fetchall(self) -> Rows:
        return self._rows


class NoPlanSizes(PlanSizes):
    """The fake pool runs only the statements scripted: no reading of the tables' sizes."""

    def changed(self, conn: object) -> bool:
        return False


def open_database(pool: FakePool) -> Database:
    db = Database(
        DatabaseConfig(url=URL), pool_factory=pool, connect=pool.connect, plan_sizes=NoPlanSizes()
    )
    db.open()
    return db


# --------------------------------------------------------------------------- the Database


def test_the_database_tries_a_statement_once_when_the_server_is_away() -> None:
    pool = FakePool([outage(), [{"n": 1}]])
    with pytest.raises(DatabaseUnavailableError, match="connection refused"):
        open_database(pool).execute(b"SELECT 1")
    assert pool.executed == 1


def test_the_database_runs_a_statement_again_after_a_conflict() -> None:
    pool = FakePool([deadlock(), deadlock(), [{"n": 1}]])
    assert open_database(pool).execute(b"SELECT 1") == [{"n": 1}]
    assert pool.executed == 3


def test_a_transaction_that_keeps_conflicting_is_run_whole_each_time_then_raised() -> None:
    # each run: a first statement that passes, a second that deadlocks
    pool = FakePool([[{"n": 1}], deadlock()] * TRANSACTION_ATTEMPTS)
    runs: list[int] = []

    def work(cur: Any) -> None:
        runs.append(1)
        cur.execute(b"UPDATE a")
        cur.execute(b"UPDATE b")

    with pytest.raises(TransactionConflictError, match="deadlock"):
        open_database(pool).run(work)
    assert len(runs) == TRANSACTION_ATTEMPTS
    assert pool.executed == 2 * TRANSACTION_ATTEMPTS
    assert pool.begun == pool.rolled_back == TRANSACTION_ATTEMPTS


def test_a_transaction_that_meets_an_outage_is_not_run_again() -> None:
    pool = FakePool([[{"n": 1}], outage()])
    runs: list[int] = []

    def work(cur: Any) -> None:
        runs.append(1)
        cur.execute(b"UPDATE a")
        cur.execute(b"UPDATE b")

    with pytest.raises(DatabaseUnavailableError):
        open_database(pool).run(work)
    assert runs == [1] and pool.begun == pool.rolled_back == 1


# --------------------------------------------------------------------------- run_role


class Failing:
    """A role whose loop raises each of ``plan`` in turn, then stops."""

    title = "Probe"

    def __init__(self, plan: list[FlowForgeError]) -> None:
        self.plan = plan
        self.initialized = self.resets = 0
        self.shut = False

    def initialize(self) -> None:
        self.initialized += 1

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        if self.plan:
            raise self.plan.pop(0)
        stop.set()

    def reset(self) -> None:
        self.resets += 1

    def shutdown(self) -> None:
        self.shut = True


def test_run_role_starts_the_loop_again_once_per_outage() -> None:
    role = Failing([DatabaseUnavailableError("away"), BrokerUnavailableError("away")])
    run_role(role, threading.Event(), backoff=NO_WAIT)
    assert (role.initialized, role.resets, role.shut) == (3, 2, True)


def test_run_role_does_not_retry_a_conflict_the_database_gave_up_on() -> None:
    role = Failing([TransactionConflictError("deadlock detected")])
    with pytest.raises(TransactionConflictError):
        run_role(role, threading.Event(), backoff=NO_WAIT)
    assert (role.initialized, role.resets, role.shut) == (1, 0, True)


# --------------------------------------------------------------------------- the worker


def run_worker(rig: Rig) -> int:
    """Run the worker under run_role until the broker is idle; the reconnects it made."""
    reconnects: list[int] = []
    rig.stop.clear()
    run_role(rig.worker, rig.stop, backoff=NO_WAIT, on_reconnect=lambda: reconnects.append(1))
    return len(reconnects)


def test_a_finish_through_an_outage_is_retried_by_the_ledger_alone() -> None:
    rig = make_rig()
    [task] = rig.publish("fast")
    rig.store.outages["finish_many"] = 2
    assert run_worker(rig) == 0  # run_role never saw the outage
    assert rig.store.count("finish_many") == 3  # one statement, tried three times
    assert rig.worker._db.resets == 2  # type: ignore[attr-defined]  # a fresh pool each time
    assert rig.store.count("claim_many") == 1 and rig.ran == [task]
    assert rig.store.tasks[task].state is TaskState.SUCCEEDED


def test_a_claim_through_an_outage_is_retried_by_run_role_alone() -> None:
    rig = make_rig()
    [task] = rig.publish("fast")
    rig.store.outages["claim_many"] = 1
    assert run_worker(rig) == 1
    assert rig.store.count("claim_many") == 2  # the failed one, and one after the reconnect
    assert rig.worker._db.resets == 0  # type: ignore[attr-defined]  # the ledger kept out
    assert rig.store.count("finish_many") == 1 and rig.ran == [task]
    assert rig.broker.unacked == 0


@pytest.mark.parametrize("statement", ["claim_many", "finish_many"])
def test_a_conflict_the_database_gave_up_on_is_retried_by_no_one(statement: str) -> None:
    rig = make_rig()
    rig.publish("fast", 2)
    rig.store.conflicts[statement] = 1
    with pytest.raises(TransactionConflictError):
        run_worker(rig)
    assert rig.store.count(statement) == 1  # not again, and a finish not task by task either
    assert rig.worker._db.resets == 0  # type: ignore[attr-defined]
    assert rig.broker.unacked == 0  # shut down: the broker has its deliveries back
