"""Pipelined transactions (store/db.py, store/part.py): fewer round trips, the same atomicity.

Round trips are counted from libpq's protocol trace of the pool's connection: every ``Sync``
the client sends is one wait for the server's answer.
"""

from __future__ import annotations

import logging
import re
import select
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import psycopg
import pytest
from psycopg.types.json import Jsonb

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.errors import FlowForgeError, NotFoundError
from flowforge.store.db import Database, LifoPool
from flowforge.store.outbox import Outbox
from flowforge.store.part import Part, Tx
from flowforge.store.plansize import PlanSizes
from flowforge.store.reads import Reads
from flowforge.store.triggers import Triggers
from tests.helpers import heard

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]
SYNC = re.compile(r"\tF\t\d+\t(?:Sync|Query)\b")


class Traced:
    """A one-connection Database whose protocol messages go to a file."""

    def __init__(self, url: str, path: Path) -> None:
        self._file: TextIO = path.open("w+")

        def factory(*args: Any, **kwargs: Any) -> LifoPool:
            def configure(conn: psycopg.Connection[Any]) -> None:
                conn.pgconn.trace(self._file.fileno())
                conn.pgconn.set_trace_flags(0)

            return LifoPool(*args, configure=configure, **kwargs)

        # the tables' sizes read at the first checkout only (store/plansize.py reads them
        # once a second): what is counted here is the statements' own traffic
        sizes = PlanSizes(clock=lambda: 0.0)
        self.db = Database(
            DatabaseConfig(url=url, pool_min=1, pool_max=1),
            pool_factory=factory,
            plan_sizes=sizes,
        )
        self.db.open()

    def round_trips(self, action: Any) -> int:
        """How many times the client waited for the server while ``action()`` ran."""
        return len(SYNC.findall(self.trace(action)))

    def statements(self, action: Any) -> str:
        """The protocol messages the client sent while ``action()`` ran."""
        return "".join(line for line in self.trace(action).splitlines(True) if "\tF\t" in line)

    def trace(self, action: Any) -> str:
        """The protocol trace written while ``action()`` ran."""
        self._file.flush()
        start = self._file.seek(0, 2)
        action()
        self._file.flush()
        self._file.seek(start)
        return self._file.read()

    def close(self) -> None:
        self.db.close()
        self._file.close()


@pytest.fixture
def traced(clean_database_url: str, tmp_path: Path) -> Iterator[Traced]:
    found = Traced(clean_database_url, tmp_path / "trace")
    yield found
    found.close()


def one_task(name: str = "w") -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("t", "x"),))


def count(sql: Conn, query: str) -> int:
    row = sql.execute(query).fetchone()
    assert row is not None
    return int(str(row[0]))


def test_a_trigger_takes_one_round_trip_and_creates_the_run(traced: Traced, sql: Conn) -> None:
    """BEGIN, the run, its task with its outbox row, COMMIT and the notification go in one
    round trip: the definition was registered by the first trigger, the task counts are not
    read (issue 22)."""
    repo = Triggers(traced.db)
    repo.trigger(one_task(), {"warm": True})  # the pool's connection is open
    results: list[Any] = []
    assert traced.round_trips(lambda: results.append(repo.trigger(one_task(), {"i": 1}))) == 1
    run_id = results[0].run_id
    assert count(sql, f"SELECT count(*) FROM task_runs WHERE run_id = '{run_id}'") == 1
    assert count(sql, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 2


def test_a_definition_is_registered_by_the_first_trigger_of_its_version_only(
    traced: Traced, sql: Conn
) -> None:
    """Statements are counted by their Execute messages: BEGIN, the runs, the tasks, COMMIT and
    the notification, plus the registration when it is sent (and, at the connection's first
    checkout, the read of the tables' sizes: store/plansize.py)."""
    repo = Triggers(traced.db)
    executes = [
        traced.statements(lambda: repo.trigger(one_task(), {"i": 0})).count("\tExecute\t"),
        traced.statements(lambda: repo.trigger(one_task(), {"i": 1})).count("\tExecute\t"),
    ]
    changed = WorkflowDef("w", (TaskDef("t", "x", timeout=9.0),))  # a new version of "w"
    executes.append(traced.statements(lambda: repo.trigger(changed)).count("\tExecute\t"))
    assert executes == [7, 5, 6]
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'w'") == 2


def test_a_definition_gone_since_it_was_registered_is_registered_again(
    traced: Traced, sql: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """A table emptied under a long-lived client (a test's cleanup, a restored database): the
    run's foreign key refuses it, and the trigger runs again with the registration, with a key
    (the refusal read at the insert's sync) or without (at the commit), and nothing logged.
    The race that made psycopg log "error ignored terminating ... pipeline aborted" after such
    a refusal (its answer read before any sync) is made to happen by
    test_an_error_read_inside_the_pipeline_is_raised_once_and_not_logged_again; here it only
    may."""
    repo = Triggers(traced.db)
    repo.trigger(one_task(), {"i": 0})
    caplog.set_level("DEBUG", logger="psycopg")
    created = []
    for key in (None, "k"):
        sql.execute("TRUNCATE workflow_definitions CASCADE")
        created.append(repo.trigger(one_task(), {"i": 1}, key).run_id)
        assert count(sql, "SELECT count(*) FROM workflow_definitions") == 1
    ids = ", ".join(f"'{c}'" for c in created)
    assert count(sql, f"SELECT count(*) FROM workflow_runs WHERE id IN ({ids})") == 1
    assert _psycopg_warnings(caplog) == []


def _psycopg_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("psycopg") and r.levelno >= logging.WARNING
    ]


def test_reading_a_run_with_its_tasks_takes_one_round_trip(traced: Traced) -> None:
    reads = Reads(traced.db)
    run_id = Triggers(traced.db).trigger(one_task(), {"i": 1}).run_id
    found: list[Any] = []
    assert traced.round_trips(lambda: found.append(reads.get_run(run_id))) == 1
    assert found[0].id == run_id and [t.name for t in found[0].tasks] == ["t"]
    with pytest.raises(NotFoundError):
        reads.get_run(uuid.uuid4())


def test_a_trigger_with_a_key_reads_its_insert_and_still_replays(traced: Traced, sql: Conn) -> None:
    repo = Triggers(traced.db)
    first = repo.trigger(one_task(), {"i": 1}, idempotency_key="k")
    results: list[Any] = []
    trips = traced.round_trips(
        lambda: results.append(repo.trigger(one_task(), {"i": 1}, idempotency_key="k"))
    )
    assert trips == 3  # the insert's result is read, then the existing run, then the commit
    assert results[0].run_id == first.run_id and not results[0].created
    assert count(sql, "SELECT count(*) FROM workflow_runs") == 1


def test_a_sweep_takes_two_round_trips_and_stamps_what_was_confirmed(
    traced: Traced, sql: Conn
) -> None:
    Triggers(traced.db).trigger_many(one_task(), [{"i": i} for i in range(3)])
    outbox = Outbox(traced.db)
    handed: list[tuple[int, int]] = []

    def sweep() -> None:
        handed.append(outbox.publish_outbox(10, lambda batch: {batch[0].outbox_id}))

    assert traced.round_trips(sweep) == 2
    assert handed == [(3, 1)]
    assert count(sql, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") == 1


class Probe(Part):
    """Named statements in a pipelined transaction, as a store part runs them."""

    def register_then(self, fail: str | None) -> int:
        def work(tx: Tx) -> int:
            definition = one_task("probe")
            tx.send(
                "register_definitions",
                {"names": ["probe"], "digests": [definition.digest], "definitions": [Jsonb({})]},
            )
            if fail == "statement":  # a foreign key no task satisfies: fails at the commit
                edge = {"upstream": [uuid.uuid4()], "downstream": [uuid.uuid4()], "names": ["up"]}
                tx.send("insert_edges", edge)
            if fail == "work":
                raise RuntimeError("the work failed after sending")
            row = tx.one("trigger_clock")
            return 1 if row is not None else 0

        return self._pipelined(work)


def test_a_failed_sent_statement_rolls_back_what_was_sent_before_it(
    traced: Traced, sql: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe(traced.db)
    caplog.set_level("DEBUG", logger="psycopg")
    with pytest.raises(FlowForgeError):
        probe.register_then(fail="statement")
    assert _psycopg_warnings(caplog) == []
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'probe'") == 0
    assert probe.register_then(fail=None) == 1  # the pool's one connection is usable again
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'probe'") == 1


@pytest.mark.parametrize("scope", ["transaction", "reads"])
def test_an_error_read_inside_the_pipeline_is_raised_once_and_not_logged_again(
    db: Database, sql: Conn, caplog: pytest.LogCaptureFixture, scope: str
) -> None:
    """A statement's error can surface before the transaction's end: at a later statement,
    before any sync, when its answer has already arrived (psycopg reads what has arrived
    whenever it sends; under load, once in a while — the full bench saw it once a run). The
    pipeline is then still aborted; left so, psycopg fails again on the way out and logs
    "error ignored terminating ... pipeline aborted". Here the answer is made to arrive first
    (a flush request, then the socket read ready). The error is raised, translated, once;
    nothing is logged; the transaction is rolled back and the connection serves the next."""
    caplog.set_level("DEBUG", logger="psycopg")
    key = uuid.uuid4().hex
    went_on = False
    pipelined = db.pipelined_transaction if scope == "transaction" else db.pipelined_reads
    with pytest.raises(FlowForgeError), pipelined() as (cur, _pipelined):
        cur.execute(
            "INSERT INTO workflow_definitions (name, digest, definition) VALUES (%s, %s, '{}')",
            ("before-the-error", key),
        )
        cur.execute("SELECT 1 / 0")  # refused
        pgconn = cur.connection.pgconn
        pgconn.send_flush_request()
        pgconn.flush()
        assert select.select([pgconn.socket], [], [], 10.0)[0], "no answer within 10 s"
        cur.execute("SELECT 1")  # the refusal comes here, inside the pipeline
        went_on = True
    assert not went_on
    assert _psycopg_warnings(caplog) == []
    assert count(sql, f"SELECT count(*) FROM workflow_definitions WHERE digest = '{key}'") == 0
    with db.pipelined_transaction() as (cur, pipelined):
        cur.execute("SELECT 2 AS n")
        pipelined.sync()
        assert cur.fetchall() == [{"n": 2}]


def test_an_exception_in_the_work_rolls_back_what_was_sent(traced: Traced, sql: Conn) -> None:
    probe = Probe(traced.db)
    with pytest.raises(RuntimeError, match="after sending"):
        probe.register_then(fail="work")
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'probe'") == 0
    assert probe.register_then(fail=None) == 1
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'probe'") == 1


class Sender(Part):
    """Sends a failing statement, then notes that it went on: where does the error come?"""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.went_on = False

    def send_bad(self, pipelined: bool) -> None:
        def work(tx: Tx) -> None:
            edge = {"upstream": [uuid.uuid4()], "downstream": [uuid.uuid4()], "names": ["up"]}
            tx.send("insert_edges", edge)  # no such tasks: refused by the foreign key
            self.went_on = True

        if pipelined:
            self._pipelined(work)
        else:
            self._transaction(work)


def test_send_raises_at_once_outside_a_pipeline_and_at_the_commit_in_one(db: Database) -> None:
    plain = Sender(db)
    with pytest.raises(FlowForgeError):
        plain.send_bad(pipelined=False)
    assert not plain.went_on
    queued = Sender(db)
    with pytest.raises(FlowForgeError):
        queued.send_bad(pipelined=True)
    assert queued.went_on


# ------------------------------------------------------------------ notifications after the commit


def test_a_pipelined_trigger_notifies_the_publisher_after_its_commit(
    traced: Traced, listening: Conn, sql: Conn
) -> None:
    """The notification is sent after the COMMIT in the same round trip, as a transaction of
    its own: the run is committed (visible to the listener) when it is heard."""
    repo = Triggers(traced.db)
    repo.trigger(one_task(), {"warm": True})
    heard(listening)
    results: list[Any] = []
    assert traced.round_trips(lambda: results.append(repo.trigger(one_task(), {"i": 1}))) == 1
    assert heard(listening) == {"flowforge_outbox"}
    run_id = results[0].run_id
    assert count(sql, f"SELECT count(*) FROM workflow_runs WHERE id = '{run_id}'") == 1


def test_a_notification_failing_after_the_commit_leaves_the_commit_and_is_not_raised(
    db: Database, sql: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    def work(scope: tuple[Any, Any]) -> None:
        cur, pipelined = scope
        cur.execute(
            "INSERT INTO workflow_definitions (name, digest, definition) VALUES ('late', 'd', '{}')"
        )
        pipelined.after_commit(b"SELECT 1/0")  # stands for a notify queue that is full

    db.run_pipelined(work)
    assert count(sql, "SELECT count(*) FROM workflow_definitions WHERE name = 'late'") == 1
    assert any(getattr(r, "action", None) == "notify_failed" for r in caplog.records)
