"""What an attempt writes and reports, stored with it in real PostgreSQL (SPEC 7.5, migration
0021): the live write and the finish, fenced by the token; the progress of the current attempt
only; a worker (in this process, real database, stub broker) that captures ``ctx.log`` and
``ctx.progress`` while the handler runs and costs no statement for a silent handler.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge import Client
from flowforge.config import BrokerConfig, DatabaseConfig, WorkerConfig, load_config
from flowforge.domain.model import Finish
from flowforge.domain.output import Captured, Output, Progress
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import InputError, NotFoundError
from flowforge.roles.context import TaskContext
from flowforge.roles.worker import Worker, WorkerStatements
from flowforge.store.db import Database
from tests.helpers import claim_task, single, wait_for
from tests.store import Store
from tests.stubs import StubBroker

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def captured(text: str, dropped: int = 0, progress: Progress | None = None) -> Captured:
    return Captured(Output(text, dropped), progress)


def test_a_running_attempt_s_output_is_stored_then_replaced_by_its_final_tail(
    repo: Store, sql: Sql
) -> None:
    run = repo.trigger(single("out-live"), {})
    task = repo.get_run(run.run_id).tasks[0]
    claim = claim_task(repo, sql, task.id)
    pair = (claim.task_run_id, claim.fencing_token)
    assert repo.write_output([(*pair, captured("one\n", 0, Progress(0.25, "a quarter")))]) == 1
    live = repo.attempt_log(task.id)
    assert (live.attempt, live.output, live.finished_at) == (1, Output("one\n", 0), None)
    assert live.task_state is TaskState.RUNNING
    assert repo.get_task(task.id).progress == Progress(0.25, "a quarter")
    # an output-only write keeps the progress
    assert repo.write_output([(*pair, captured("one\ntwo\n"))]) == 1
    assert repo.get_task(task.id).progress == Progress(0.25, "a quarter")
    final = Finish(
        TaskState.SUCCEEDED, result=1, captured=captured("two\nthree\n", 4, Progress(1.0, ""))
    )
    repo.finish_many([(*pair, final)])
    done = repo.attempt_log(task.id, 1)
    assert done.output == Output("two\nthree\n", 4) and done.finished_at is not None
    assert done.outcome == "succeeded"
    assert repo.get_task(task.id).progress == Progress(1.0, "")
    # a write that comes after the finish (a stale token or state) changes nothing
    assert repo.write_output([(*pair, captured("late\n"))]) == 0
    assert repo.attempt_log(task.id).output.text == "two\nthree\n"


def test_a_silent_attempt_s_finish_keeps_what_was_written_live(repo: Store, sql: Sql) -> None:
    run = repo.trigger(single("out-keep"), {})
    task = repo.get_run(run.run_id).tasks[0]
    claim = claim_task(repo, sql, task.id)
    pair = (claim.task_run_id, claim.fencing_token)
    repo.write_output([(*pair, captured("written live\n", 0, Progress(0.5, "")))])
    repo.finish_many([(*pair, Finish(TaskState.SUCCEEDED))])  # nothing captured: NULLs
    assert repo.attempt_log(task.id).output == Output("written live\n", 0)
    assert repo.get_task(task.id).progress == Progress(0.5, "")


def test_progress_is_the_current_attempt_s_and_logs_are_per_attempt(repo: Store, sql: Sql) -> None:
    run = repo.trigger(single("out-retry"), {})
    task = repo.get_run(run.run_id).tasks[0]
    first = claim_task(repo, sql, task.id)
    failed = Finish(
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error="boom",
        captured=captured("first try\n", 0, Progress(0.9, "x")),
    )
    repo.finish_many([(first.task_run_id, first.fencing_token, failed)])
    sql.execute(
        "UPDATE task_runs SET state = 'READY', fencing_token = fencing_token + 1, "
        "failure_reason = NULL WHERE id = %s",
        (task.id,),
    )
    sql.execute(
        "INSERT INTO outbox (task_run_id, fencing_token, queue) "
        "SELECT id, fencing_token, queue FROM task_runs WHERE id = %s",
        (task.id,),
    )
    claim_task(repo, sql, task.id)
    # the second attempt reported nothing yet: the first one's progress is not shown for it
    assert repo.get_task(task.id).progress is None
    assert repo.get_run(run.run_id).tasks[0].progress is None
    latest = repo.attempt_log(task.id)
    assert (latest.attempt, latest.attempts, latest.output.text) == (2, 2, "")
    assert repo.attempt_log(task.id, 1).output.text == "first try\n"


def test_unknown_task_runs_attempts_and_bad_numbers_are_refused(repo: Store) -> None:
    run = repo.trigger(single("out-none"), {})
    task = repo.get_run(run.run_id).tasks[0]
    before = repo.attempt_log(task.id)  # no attempt yet: nothing to show, not an error
    assert (before.attempt, before.attempts, before.output) == (None, 0, Output("", 0))
    with pytest.raises(NotFoundError, match="has no attempt 1"):
        repo.attempt_log(task.id, 1)
    with pytest.raises(NotFoundError, match="no task run"):
        repo.attempt_log(UUID(int=7))
    for bad in (0, -1, 2**31, True, 1.5):
        with pytest.raises(InputError, match="attempt must be"):
            repo.attempt_log(task.id, bad)  # type: ignore[arg-type]


class Counting(WorkerStatements):
    """The worker's statements, each call counted by name (one call is one statement)."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.calls: dict[str, int] = {}

    def write_output(self, captured: Any) -> int:
        self.calls["write_output"] = self.calls.get("write_output", 0) + 1
        return super().write_output(captured)

    def renew_leases(self, claims: Any, lease_s: float) -> dict[UUID, bool]:
        self.calls["renew_leases"] = self.calls.get("renew_leases", 0) + 1
        return super().renew_leases(claims, lease_s)


def run_worker(
    url: str, repo: Store, handler: Any, *, capture_bytes: int = 64 * 1024, flush_ms: float = 50
) -> tuple[UUID, Counting]:
    """Trigger a one-task run of ``handler`` and run a worker on it until it is done."""
    config = dataclasses.replace(
        load_config(env={}),
        database=DatabaseConfig(url=url, pool_min=1, pool_max=4),
        broker=BrokerConfig(prefetch=4),
        worker=WorkerConfig(
            lease_s=30,
            heartbeat_s=10,
            fast_handler_ms=20,
            listen_for_cancel=False,
            log_capture_bytes=capture_bytes,
            output_flush_ms=flush_ms,
        ),
    )
    run = repo.trigger(single("out-worker", "talk"), {})
    task = repo.get_run(run.run_id).tasks[0]
    stop = threading.Event()
    broker = StubBroker(on_idle=stop.set)
    broker.publish(task.id, task.fencing_token)
    db = Database(config.database, application_name="flowforge-worker")
    store = Counting(db)
    worker = Worker(config, handlers={"talk": handler}, broker=broker, store=store, db=db)
    try:
        worker.initialize()
        worker.loop(stop, lambda: None)
    finally:
        worker.shutdown()
    return task.id, store


def test_a_worker_writes_ctx_log_and_progress_while_the_handler_runs(
    repo: Store, clean_database_url: str
) -> None:
    seen_live = threading.Event()
    ids: list[UUID] = []

    def talk(ctx: TaskContext) -> str:
        ids.append(ctx.task_run_id)
        ctx.log.info("loaded %d rows", 3)
        ctx.progress(0.4, "halfway \x1b[31mthere")
        # the test's thread reads the database until it sees both, while this still runs
        assert seen_live.wait(20), "the running attempt's output never reached the database"
        try:
            raise KeyError("boom")
        except KeyError:
            ctx.log.exception("caught")
        ctx.log.debug("not at the tree's log level")  # INFO: not kept
        return "ok"

    def watch() -> None:
        def live() -> bool:
            if not ids:
                return False
            task = repo.get_task(ids[0])
            return "loaded 3 rows" in repo.attempt_log(ids[0]).output.text and (
                task.progress == Progress(0.4, "halfway \x1b[31mthere")
            )

        wait_for(live, timeout=20, what="the live output and progress")
        seen_live.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    task_id, store = run_worker(clean_database_url, repo, talk)
    watcher.join(20)
    assert seen_live.is_set()
    log = repo.attempt_log(task_id)
    lines = log.output.text.splitlines()
    assert lines[0] == "INFO loaded 3 rows"
    assert lines[1] == "ERROR caught"
    assert "Traceback (most recent call last):" in lines and "KeyError: 'boom'" in lines
    assert not any("tree's log level" in line for line in lines)
    assert log.outcome == "succeeded" and log.output.dropped == 0
    assert store.calls.get("write_output", 0) >= 1


def test_a_silent_handler_costs_no_output_statement(repo: Store, clean_database_url: str) -> None:
    def silent(ctx: TaskContext) -> None:
        time.sleep(0.4)  # slow (past fast_handler_ms) and eight flush intervals long

    task_id, store = run_worker(clean_database_url, repo, silent)
    assert repo.get_task(task_id).state is TaskState.SUCCEEDED
    assert store.calls.get("write_output", 0) == 0
    assert repo.attempt_log(task_id).output == Output("", 0)
    assert repo.get_task(task_id).progress is None


def test_a_handler_that_logs_a_megabyte_keeps_the_tail_within_the_limit(
    repo: Store, clean_database_url: str
) -> None:
    limit = 4096
    line = "x" * 99  # "INFO ", the number and the newline: 111 bytes a record

    def loud(ctx: TaskContext) -> None:
        for i in range(10_000):
            ctx.log.info("%s %05d", line, i)

    task_id, _ = run_worker(clean_database_url, repo, loud, capture_bytes=limit)
    log = repo.attempt_log(task_id)
    kept = log.output.text.encode()
    assert len(kept) <= limit
    assert log.output.dropped + len(kept) == 10_000 * 111
    assert log.output.text.endswith(f"INFO {line} 09999\n")
    assert log.output.text.startswith("INFO ")  # whole lines are dropped, not halves


def test_the_client_reads_an_attempt_s_output(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run = repo.trigger(single("out-client"), {})
    task = repo.get_run(run.run_id).tasks[0]
    claim = claim_task(repo, sql, task.id)
    repo.write_output([(claim.task_run_id, claim.fencing_token, captured("hello\n", 3))])
    config = dataclasses.replace(
        load_config(env={}), database=DatabaseConfig(url=clean_database_url)
    )
    with Client(config) as client:
        found = client.logs(task.id)
        assert (found.attempt, found.output) == (1, Output("hello\n", 3))
        assert client.logs(str(task.id), 1) == found
        with pytest.raises(NotFoundError):
            client.logs(task.id, 2)
