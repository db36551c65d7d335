"""Rate limits (issue 20, SPEC 7.4) against real PostgreSQL: the admission gate's window.

A task with ``rate_limit: {limit, per, key}`` never becomes READY by itself; the admission pass
(and a trigger) admits it while its key's READY tasks plus the attempts of its tasks STARTED
within the last ``per`` seconds are fewer than ``limit``. Time passing is the database's: a test
moves a start out of the window by moving its ``started_at`` back, never by sleeping. Every
count is read from the database.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.control import HoldKind
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from tests.api_client import serve_config, write_config
from tests.cli_runner import assert_ok
from tests.cli_runner import run_config as flowforge
from tests.helpers import claim_task, drain, race, until_idle
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries due at once: a failed task's retry goes back through admission in the next pass.
NOW_RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
#: A window no test outlives: a start leaves it only when a test moves it back.
PER_S = 600.0


def rated(limit: int, key: str | None = "partner", name: str = "rated", **task: Any) -> WorkflowDef:
    """One task of handler tests.noop with ``rate_limit: {limit, per: PER_S, key}``."""
    return WorkflowDef(
        name, (TaskDef("call", "tests.noop", rate_limit=RateLimit(limit, PER_S, key), **task),)
    )


def by_state(sql: Sql, key: str) -> dict[str, int]:
    """The tasks of rate key ``key`` counted by state."""
    rows = sql.execute(
        "SELECT state, count(*) FROM task_runs WHERE rate_key = %s GROUP BY state", (key,)
    ).fetchall()
    return {str(state): int(n) for state, n in rows}


def by_concurrency_key(sql: Sql, key: str) -> dict[str, int]:
    rows = sql.execute(
        "SELECT state, count(*) FROM task_runs WHERE concurrency_key = %s GROUP BY state", (key,)
    ).fetchall()
    return {str(state): int(n) for state, n in rows}


def used(sql: Sql, key: str) -> int:
    """What the window of ``key`` holds: READY tasks (each will start) and starts within it."""
    row = sql.execute(
        "SELECT (SELECT count(*) FROM task_runs WHERE rate_key = %(k)s AND state = 'READY')"
        " + (SELECT count(*) FROM task_attempts WHERE rate_key = %(k)s"
        "     AND started_at > now() - make_interval(secs => %(per)s))",
        {"k": key, "per": PER_S},
    ).fetchone()
    assert row is not None
    return int(row[0])


def ready_ids(sql: Sql, key: str) -> list[UUID]:
    rows = sql.execute(
        "SELECT id FROM task_runs WHERE rate_key = %s AND state = 'READY' ORDER BY seq", (key,)
    ).fetchall()
    return [UUID(str(r[0])) for r in rows]


def start_all(repo: Store, sql: Sql, key: str) -> None:
    """Every READY task of ``key`` claimed (its attempt starts now) and finished."""
    for tid in ready_ids(sql, key):
        claim = claim_task(repo, sql, tid)
        assert repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED)


def age_starts(sql: Sql, key: str, seconds: float) -> None:
    """The database clock moved on by ``seconds`` for ``key``'s starts: each is that much older."""
    sql.execute(
        "UPDATE task_attempts SET started_at = started_at - make_interval(secs => %s)"
        " WHERE rate_key = %s",
        (seconds, key),
    )


def test_admits_at_most_limit_per_window_oldest_first_without_using_an_attempt(
    repo: Store, sql: Sql
) -> None:
    runs = [repo.trigger(rated(3)).run_id for _ in range(10)]
    # the triggers admitted while the window had room (no scheduler hop), then left the rest
    assert by_state(sql, "partner") == {"READY": 3, "PENDING": 7}
    drain(repo)
    assert by_state(sql, "partner") == {"READY": 3, "PENDING": 7}  # READY ones count: no more
    assert set(ready_ids(sql, "partner")) == {repo.get_run(r).tasks[0].id for r in runs[:3]}
    waiting = repo.get_run(runs[5]).tasks[0]
    assert (waiting.state, waiting.attempt, waiting.waiting_on) == (
        TaskState.PENDING,
        0,
        "rate_limit",
    )
    assert (waiting.rate_key, waiting.rate_limit, waiting.rate_per_s) == ("partner", 3, PER_S)
    start_all(repo, sql, "partner")
    drain(repo)  # three starts in the window: still no room
    assert by_state(sql, "partner") == {"SUCCEEDED": 3, "PENDING": 7}
    age_starts(sql, "partner", PER_S / 2)
    drain(repo)
    assert by_state(sql, "partner") == {"SUCCEEDED": 3, "PENDING": 7}  # still within per
    age_starts(sql, "partner", PER_S / 2 + 1)
    drain(repo)  # out of the window now: three more, the next oldest
    assert set(ready_ids(sql, "partner")) == {repo.get_run(r).tasks[0].id for r in runs[3:6]}
    assert [repo.get_run(r).tasks[0].attempt for r in runs[6:]] == [0] * 4


def test_a_window_counts_starts_not_finishes_and_only_its_own_per(repo: Store, sql: Sql) -> None:
    for _ in range(4):
        repo.trigger(rated(2))
    (first, second) = ready_ids(sql, "partner")
    claim = claim_task(repo, sql, first)  # started, still RUNNING: counts as a start
    drain(repo)
    assert by_state(sql, "partner") == {"RUNNING": 1, "READY": 1, "PENDING": 2}
    age_starts(sql, "partner", PER_S + 1)  # its start left the window, though it still runs
    drain(repo)
    assert by_state(sql, "partner") == {"RUNNING": 1, "READY": 2, "PENDING": 1}
    assert repo.finish(first, claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)  # a finish frees nothing: the READY two fill the window
    assert by_state(sql, "partner") == {"SUCCEEDED": 1, "READY": 2, "PENDING": 1}
    assert second in ready_ids(sql, "partner")


def test_a_claim_handed_back_is_no_start_and_keeps_its_place(repo: Store, sql: Sql) -> None:
    for _ in range(3):
        repo.trigger(rated(1))
    (held,) = ready_ids(sql, "partner")
    claim = claim_task(repo, sql, held)
    assert repo.release_claims([(held, claim.fencing_token)])  # its handler never started
    assert sql.execute(
        "SELECT count(*) FROM task_attempts WHERE task_run_id = %s", (held,)
    ).fetchone() == (0,)
    drain(repo)  # READY again: it holds the window's one place, nothing else is admitted
    assert by_state(sql, "partner") == {"READY": 1, "PENDING": 2}
    assert used(sql, "partner") == 1


def test_a_retry_is_a_new_start_and_waits_for_the_window(repo: Store, sql: Sql) -> None:
    run = repo.trigger(rated(2, retry=NOW_RETRY)).run_id
    repo.trigger(rated(2))
    tid = repo.get_run(run).tasks[0].id
    claim = claim_task(repo, sql, tid)
    assert repo.finish(
        tid, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    drain(repo)  # routed to RETRYING, due now: but 1 start + 1 READY fill the window
    task = repo.get_task(tid)
    assert (task.state, task.waiting_on) == (TaskState.RETRYING, "rate_limit")
    age_starts(sql, "partner", PER_S + 1)
    drain(repo)
    assert repo.get_task(tid).state is TaskState.READY
    claim = claim_task(repo, sql, tid)
    assert claim.attempt == 2  # held back, it used no attempt


def test_retry_now_of_a_rate_limited_task_goes_through_admission(repo: Store, sql: Sql) -> None:
    slow = RetryPolicy(max_attempts=3, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)
    run = repo.trigger(rated(1, retry=slow)).run_id
    tid = repo.get_run(run).tasks[0].id
    claim = claim_task(repo, sql, tid)
    assert repo.finish(
        tid, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    drain(repo)
    token = repo.get_task(tid).fencing_token
    done = repo.retry_task_now(tid, "ops", "partner is back")
    assert done.task.state is TaskState.RETRYING  # due now, but its start fills the window
    assert repo.get_task(tid).waiting_on == "rate_limit"
    assert repo.get_task(tid).fencing_token == token
    age_starts(sql, "partner", PER_S + 1)
    drain(repo)
    assert repo.get_task(tid).state is TaskState.READY


def test_keys_render_per_input_and_default_to_the_handler(repo: Store, sql: Sql) -> None:
    per_input = WorkflowDef(
        "per-input",
        (TaskDef("call", "tests.noop", rate_limit=RateLimit(1, PER_S, "p-{partner}")),),
    )
    for partner in ("a", "a", "b", "b", "b"):
        repo.trigger(per_input, {"partner": partner})
    assert by_state(sql, "p-a") == {"READY": 1, "PENDING": 1}
    assert by_state(sql, "p-b") == {"READY": 1, "PENDING": 2}
    for name in ("one", "two"):  # no key: the handler's, across workflows
        repo.trigger(rated(1, key=None, name=name))
    assert by_state(sql, "tests.noop") == {"READY": 1, "PENDING": 1}


def test_unlimited_tasks_keep_their_path(repo: Store, sql: Sql) -> None:
    run = repo.trigger(WorkflowDef("free", (TaskDef("call", "tests.noop"),))).run_id
    task = repo.get_run(run).tasks[0]
    assert (task.state, task.rate_key, task.waiting_on) == (TaskState.READY, None, None)
    claim_task(repo, sql, task.id)
    assert sql.execute(
        "SELECT rate_key FROM task_attempts WHERE task_run_id = %s", (task.id,)
    ).fetchone() == (None,)


def test_a_dependent_waits_for_admission_after_its_upstream(repo: Store, sql: Sql) -> None:
    workflow = WorkflowDef(
        "chained",
        (
            TaskDef("first", "tests.noop"),
            TaskDef(
                "then", "tests.noop", depends_on=("first",), rate_limit=RateLimit(1, PER_S, "k")
            ),
        ),
    )
    run = repo.trigger(workflow).run_id
    first = next(t for t in repo.get_run(run).tasks if t.name == "first")
    claim = claim_task(repo, sql, first.id)
    assert repo.finish(first.id, claim.fencing_token, TaskState.SUCCEEDED)
    then = next(t for t in repo.get_run(run).tasks if t.name == "then")
    assert (then.state, then.waiting_on) == (TaskState.PENDING, "rate_limit")
    drain(repo)
    assert repo.get_task(then.id).state is TaskState.READY


def both(tenant: str, limit: int = 1, rate: int = 3) -> WorkflowDef:
    return WorkflowDef(
        f"both-{tenant}",
        (
            TaskDef(
                "call",
                "tests.noop",
                concurrency=Concurrency(f"tenant-{tenant}", limit),
                rate_limit=RateLimit(rate, PER_S, "partner"),
            ),
        ),
    )


def test_rate_and_concurrency_together_must_both_have_room(repo: Store, sql: Sql) -> None:
    runs = [repo.trigger(both("a")).run_id for _ in range(5)]
    assert by_state(sql, "partner") == {"READY": 1, "PENDING": 4}  # the concurrency slot
    assert repo.get_run(runs[1]).tasks[0].waiting_on == "concurrency"
    for _ in range(2):  # two more pass both gates, one at a time
        start_all(repo, sql, "partner")
        drain(repo)
        assert by_state(sql, "partner")["READY"] == 1
    start_all(repo, sql, "partner")
    drain(repo)  # three starts: the slot is free, the window is not
    assert by_state(sql, "partner") == {"SUCCEEDED": 3, "PENDING": 2}
    assert repo.get_run(runs[3]).tasks[0].waiting_on == "rate_limit"
    age_starts(sql, "partner", PER_S + 1)
    drain(repo)
    assert by_state(sql, "partner") == {"SUCCEEDED": 3, "READY": 1, "PENDING": 1}


def test_a_task_held_by_its_concurrency_key_takes_no_rate_room(repo: Store, sql: Sql) -> None:
    for _ in range(3):
        repo.trigger(both("a", rate=2))  # oldest: tenant a, one slot
    for _ in range(2):
        repo.trigger(both("b", rate=2))
    # (b's trigger leaves its task to the pass: a's waiting tasks go first at a trigger)
    drain(repo)
    # a's first and b's first: a's others are held by their slot and leave the window to b
    assert by_concurrency_key(sql, "tenant-a") == {"READY": 1, "PENDING": 2}
    assert by_concurrency_key(sql, "tenant-b") == {"READY": 1, "PENDING": 1}
    assert by_state(sql, "partner") == {"READY": 2, "PENDING": 3}


def counts_within_limit(sql: Sql, keys: tuple[str, ...], limit: int) -> None:
    for key in keys:
        assert used(sql, key) <= limit, (key, by_state(sql, key))


def test_two_racing_schedulers_and_a_trigger_never_admit_over_the_limit(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    keys = ("k1", "k2", "k3")
    for key in keys:
        for _ in range(20):
            repo.trigger(rated(4, key=key, name=f"wf-{key}"))
    sql.execute("UPDATE task_runs SET state = 'PENDING', ready_at = NULL")  # all waiting
    sql.execute("DELETE FROM outbox")

    def trigger(store: Store) -> int:
        for key in keys:
            store.trigger(rated(4, key=key, name=f"wf-{key}"))
        return 0

    for _ in range(5):  # rounds: race, check, start a few, age the window
        admitted = race(
            clean_database_url,
            until_idle(lambda s: s.admit_gated(100)),
            until_idle(lambda s: s.admit_gated(100)),
            trigger,
        )
        for key in keys:
            assert used(sql, key) == 4, (key, admitted, by_state(sql, key))
            for tid in ready_ids(sql, key)[:2]:  # two start: the window is still full
                claim_task(repo, sql, tid)
        drain(repo)
        counts_within_limit(sql, keys, 4)
        for key in keys:
            age_starts(sql, key, PER_S + 1)  # the two starts leave the window: two places


def test_the_scheduler_wakes_when_the_window_next_has_room(repo: Store, sql: Sql) -> None:
    for _ in range(3):
        repo.trigger(rated(1))
    assert repo.next_due_s(["rated"]) is None  # READY, not started: nothing will age out
    start_all(repo, sql, "partner")
    due = repo.next_due_s(["rated"])
    assert due is not None and PER_S - 5 < due <= PER_S
    age_starts(sql, "partner", PER_S - 10)
    due = repo.next_due_s(["rated"])
    assert due is not None and 5 < due <= 10
    age_starts(sql, "partner", 11)
    drain(repo)
    assert by_state(sql, "partner") == {"SUCCEEDED": 1, "READY": 1, "PENDING": 1}


def test_keys_show_reports_a_rate_key(repo: Store, sql: Sql) -> None:
    for _ in range(5):
        repo.trigger(rated(3))
    running = ready_ids(sql, "partner")[0]
    claim_task(repo, sql, running)
    (hold,) = repo.key_holds("partner")
    assert (hold.kind, hold.limit, hold.per_s, hold.started, hold.waiting) == (
        HoldKind.RATE_LIMIT,
        3,
        PER_S,
        1,
        2,
    )
    assert sorted((t.state, t.why) for t in hold.holders) == [
        (TaskState.READY, "READY: admitted, counts in the window until it starts"),
        (TaskState.READY, "READY: admitted, counts in the window until it starts"),
        (TaskState.RUNNING, "running (its start counts in the window)"),
    ]
    assert [t.why for t in hold.next] == ["waits for room in the key's window"] * 2


def test_keys_show_and_status_through_the_cli_and_the_api(
    tmp_path: Path, clean_database_url: str, repo: Store, sql: Sql
) -> None:
    config = write_config(tmp_path, clean_database_url, {})
    runs = [repo.trigger(rated(1)).run_id for _ in range(3)]
    start_all(repo, sql, "partner")
    out = assert_ok(flowforge(config, "keys", "show", "partner"))
    assert "rate_limit key 'partner' (1 per 600s): 1 started in the last 600s" in out
    assert "0 READY, 2 waiting" in out and "waits for room in the key's window" in out
    data = json.loads(assert_ok(flowforge(config, "keys", "show", "partner", "--json")))
    (hold,) = data["holds"]
    assert (hold["kind"], hold["limit"], hold["per_s"], hold["started"], hold["waiting"]) == (
        "rate_limit",
        1,
        PER_S,
        1,
        2,
    )
    status = json.loads(assert_ok(flowforge(config, "status", str(runs[2]), "--json")))
    (task,) = status["tasks"]
    assert (task["waiting_on"], task["rate_key"], task["rate_limit"], task["rate_per_s"]) == (
        "rate_limit",
        "partner",
        1,
        PER_S,
    )
    assert "rate_limit" in assert_ok(flowforge(config, "status", str(runs[2])))  # WAITING_ON column
    with serve_config(config) as api:
        assert api.get("/api/v1/keys?key=partner").json()["holds"][0]["kind"] == "rate_limit"
        reply = api.get(f"/api/v1/task-runs/{task['id']}").json()
        assert reply["task"]["waiting_on"] == "rate_limit"
