"""Concurrency and rate limits on a map's items (issue 20, SPEC 7.3 and 7.4) against real
PostgreSQL, counting in the database.

Each item is created by the expansion with its keys rendered per item, so it is not
``ready_by_itself``: only the admission pass makes it READY. The tests play the worker through
the real claim and finish statements and the scheduler pass by pass (tests/helpers.py
``drain``); peaks are read from ``task_attempts`` (an attempt's start and finish), windows from
its starts — time moved by moving starts back, never by sleeping.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.client import Client
from flowforge.config import load_config
from flowforge.domain.control import HoldKind
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from flowforge.store import queries
from flowforge.store.db import Database
from flowforge.store.limits import CONCURRENCY_LOCK_NAMESPACE, MAP_LOCK_NAMESPACE
from tests.api_client import Api, assert_json_error, serve_config, write_config
from tests.cli_runner import assert_refused, run_config
from tests.helpers import (
    claim_task,
    dispatch,
    drain,
    race,
    run_list,
    running_peaks,
    task_ids,
    until_idle,
    wait_for,
)
from tests.integration.test_concurrency_limits import waits_on_advisory_lock
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries due at once: a failed item's retry goes back through admission in the next pass.
NOW_RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
#: A rate window no test outlives: a start leaves it only when a test moves it back.
PER_S = 600.0
TENANT_KEY = "t-{item[tenant]}"


def mapped(max_parallel: int | None = None, **limits: Any) -> WorkflowDef:
    """list → process (a map over list's result, with ``limits``) → merge."""
    return WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.noop", for_each="list", max_parallel=max_parallel, **limits),
            TaskDef("merge", "tests.noop", depends_on=("process",)),
        ),
    )


def tenants(*counts: tuple[str, int]) -> list[dict[str, Any]]:
    """Items ``{"tenant": t, "n": i}``, interleaved so every tenant has items early and late."""
    rows = [{"tenant": t, "n": i} for t, n in counts for i in range(n)]
    random.Random(7).shuffle(rows)
    return rows


def items(sql: Sql, run_id: UUID) -> list[tuple[Any, ...]]:
    """(item_index, state, concurrency_key, rate_key, ready_by_itself, id) in item order."""
    return sql.execute(
        "SELECT item_index, state, concurrency_key, rate_key, ready_by_itself, id"
        "  FROM task_runs WHERE run_id = %s AND map_id IS NOT NULL ORDER BY item_index",
        (run_id,),
    ).fetchall()


def held(sql: Sql, column: str = "concurrency_key") -> dict[str, int]:
    """Per key: the items READY or RUNNING now (the slots the admission counts)."""
    rows = sql.execute(
        f"SELECT {column}, count(*) FROM task_runs"  # column: one of two names, never input
        " WHERE map_id IS NOT NULL AND state IN ('READY', 'RUNNING') GROUP BY 1"
    ).fetchall()
    return {str(k): int(n) for k, n in rows}


def outbox(sql: Sql) -> int:
    """Outbox rows of items: one per dispatch (an admission writes one)."""
    row = sql.execute(
        "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " WHERE t.map_id IS NOT NULL"
    ).fetchone()
    assert row is not None
    return int(row[0])


def peaks(sql: Sql, column: str = "concurrency_key") -> dict[str, int]:
    """Per key (``column`` of the item; 'all' for every item), the most item attempts running
    at one instant, from task_attempts."""
    return running_peaks(
        sql.execute(
            f"SELECT coalesce({column}::text, 'all'), a.started_at, a.finished_at"
            "  FROM task_attempts a JOIN task_runs t ON t.id = a.task_run_id"
            " WHERE t.map_id IS NOT NULL"
        )
    )


def work(
    repo: Store,
    sql: Sql,
    check: Callable[[], None],
    *,
    fail_first: bool = False,
    steps: int = 400,
) -> None:
    """Play workers until no item is unfinished: each step drains the scheduler, claims every
    dispatched item through the real claim, runs ``check`` (the invariant, read from the
    database), then finishes one running item (the first attempt of each fails when
    ``fail_first``, so its retry goes back through admission)."""
    rng = random.Random(11)
    running: list[tuple[UUID, int, int]] = []
    for _ in range(steps):
        drain(repo)
        for tid, token in dispatch(sql):
            outcome = repo.claim(tid, token, "w", 30.0)
            if outcome.claim is not None:
                running.append((tid, outcome.claim.fencing_token, outcome.claim.attempt))
        check()
        if not running:
            left = sql.execute(
                "SELECT count(*) FROM task_runs WHERE map_id IS NOT NULL"
                " AND state NOT IN ('SUCCEEDED', 'DEAD', 'CANCELLED')"
            ).fetchone()
            assert left is not None
            assert left[0] == 0, f"{left[0]} items unfinished and none dispatched"
            return
        tid, token, attempt = running.pop(rng.randrange(len(running)))
        if fail_first and attempt == 1:
            assert repo.finish(
                tid, token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="x"
            )
        else:
            assert repo.finish(tid, token, TaskState.SUCCEEDED, result=str(tid))
    raise AssertionError(f"the map did not finish within {steps} steps")


def test_keyed_items_are_created_with_their_keys_and_never_ready_by_themselves(
    repo: Store, sql: Sql
) -> None:
    wf = mapped(concurrency=Concurrency(TENANT_KEY, 2), rate_limit=RateLimit(50, PER_S))
    run_id = run_list(repo, sql, [{"tenant": "a"}, {"tenant": "b"}, {"tenant": "a"}], wf)
    rows = items(sql, run_id)
    assert [(r[2], r[3], r[4]) for r in rows] == [
        ("t-a", "tests.noop", False),
        ("t-b", "tests.noop", False),
        ("t-a", "tests.noop", False),
    ]
    limits = sql.execute(
        "SELECT DISTINCT concurrency_limit, rate_limit, rate_per_s FROM task_runs"
        " WHERE map_id IS NOT NULL"
    ).fetchall()
    assert limits == [(2, 50, PER_S)]
    # the map's own row carries no key: it is never admitted, never dispatched
    process = repo.get_task(task_ids(repo, run_id)["process"])
    assert (process.concurrency_key, process.rate_key) == (None, None)
    # an unlimited map's items are ready_by_itself, as before
    free = run_list(repo, sql, [1, 2], mapped())
    assert [r[4] for r in items(sql, free)] == [True, True]


def test_a_maps_items_never_hold_more_than_the_limit_per_key(repo: Store, sql: Sql) -> None:
    limit = 2
    wf = mapped(concurrency=Concurrency(TENANT_KEY, limit))
    run_id = run_list(repo, sql, tenants(("a", 9), ("b", 7), ("c", 4)), wf)
    # admitted in the expansion's pass: two per tenant, the rest waiting on their key
    assert held(sql) == {"t-a": 2, "t-b": 2, "t-c": 2}
    waiting = [r for r in items(sql, run_id) if r[1] == "PENDING"]
    assert len(waiting) == 14
    item = repo.get_task(waiting[0][5])
    assert (item.waiting_on, item.attempt, item.concurrency_limit) == ("concurrency", 0, limit)
    # the map's items page says it too, item by item
    page = repo.map_page(task_ids(repo, run_id)["process"], limit=500)
    assert {(i.state, i.waiting_on) for i in page.items} == {
        (TaskState.READY, None),
        (TaskState.PENDING, "concurrency"),
    }

    def check() -> None:
        assert all(n <= limit for n in held(sql).values()), held(sql)

    work(repo, sql, check)
    drain(repo)
    found = peaks(sql)
    assert found == {"t-a": limit, "t-b": limit, "t-c": limit}  # reached, never passed
    run = repo.get_run(run_id)
    assert {t.name: t.state for t in run.tasks}["process"] is TaskState.SUCCEEDED
    assert sql.execute(
        "SELECT max(attempt) FROM task_runs WHERE map_id IS NOT NULL"
    ).fetchone() == (1,)  # no held-back item used an attempt


def test_max_parallel_and_concurrency_together_each_bound_the_items(repo: Store, sql: Sql) -> None:
    """An item needs room in its key and in its map: at most max_parallel items of the map
    READY or RUNNING, at most limit per key among them."""
    max_parallel, limit = 4, 2
    wf = mapped(max_parallel, concurrency=Concurrency(TENANT_KEY, limit))
    run_list(repo, sql, tenants(("a", 8), ("b", 8), ("c", 8)), wf)

    def check() -> None:
        assert sum(held(sql).values()) <= max_parallel
        assert all(n <= limit for n in held(sql).values()), held(sql)

    work(repo, sql, check)
    drain(repo)
    per_key = peaks(sql)
    assert max(per_key.values()) == limit and len(per_key) == 3
    assert peaks(sql, "NULL")["all"] == max_parallel  # every item on one timeline: reached


def test_an_item_waiting_for_its_key_holds_no_max_parallel_slot(repo: Store, sql: Sql) -> None:
    """max_parallel counts the items READY or RUNNING: a tenant whose key is full waits on its
    key while the map keeps max_parallel items busy with the other tenants' — at every step
    where anything is left for them, from the expansion on."""
    max_parallel, limit = 4, 1
    wf = mapped(max_parallel, concurrency=Concurrency(TENANT_KEY, limit))
    crowd = [{"tenant": "a"}] * 6 + [{"tenant": t} for t in "bcdefgh" for _ in range(2)]
    run_id = run_list(repo, sql, crowd, wf)
    rows = items(sql, run_id)
    # a[0] and the first of b, c, d: four busy although a's five others come first in the list
    assert [r[0] for r in rows if r[1] == "READY"] == [0, 6, 8, 10]
    why = {r[0]: repo.get_task(r[5]).waiting_on for r in rows if r[1] == "PENDING"}
    assert {why[i] for i in range(1, 6)} == {"concurrency"}  # a's: its key is full
    assert {why[i] for i in range(12, 20)} == {None}  # the map is full: as behind a slot
    busy_while_a_waits: list[int] = []

    def check() -> None:
        now = held(sql)
        assert sum(now.values()) <= max_parallel and max(now.values(), default=0) <= limit
        waiting = sql.execute(
            "SELECT concurrency_key, count(*) FROM task_runs WHERE map_id IS NOT NULL"
            " AND state = 'PENDING' GROUP BY 1"
        ).fetchall()
        keys_left = {str(k) for k, _ in waiting}
        if now.get("t-a") == limit and keys_left - {"t-a"} - set(now):
            # a's key full and some other tenant with items left and none busy: the map must
            # be full (before, an item of a waiting for its key kept the slot)
            busy_while_a_waits.append(sum(now.values()))

    work(repo, sql, check)
    drain(repo)
    assert busy_while_a_waits and set(busy_while_a_waits) == {max_parallel}
    per_key = peaks(sql)
    assert max(per_key.values()) == limit and len(per_key) == 8
    assert peaks(sql, "NULL")["all"] == max_parallel
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


def test_two_racing_schedulers_never_admit_a_map_over_its_max_parallel(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """Schedulers admitting items of one map for different keys take turns on the map's lock:
    across rounds of two free-running passes, the map's busy items never pass max_parallel."""
    max_parallel = 3
    wf = mapped(max_parallel, concurrency=Concurrency(TENANT_KEY, 2))
    run_list(repo, sql, tenants(*((t, 4) for t in "abcdef")), wf)
    for _ in range(6):
        race(
            clean_database_url,
            until_idle(lambda s: s.admit_gated(100)),
            until_idle(lambda s: s.admit_gated(100)),
        )
        assert sum(held(sql).values()) == max_parallel, held(sql)
        for tid, token in dispatch(sql)[:2]:  # two finish, freeing two slots of the map
            claim = repo.claim(tid, token, "w", 30.0).claim
            assert claim is not None
            assert repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED)


def test_a_second_admission_for_another_key_waits_for_the_maps_lock(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """The interleaving a race rarely hits, forced: A has admitted tenant a's item into the
    map's last slot (uncommitted) when B admits for tenant b — another key, so no key's lock
    orders them. B must wait on the map's lock and then count A's item; without that lock B
    would admit b's item too (2 busy, max_parallel 1)."""
    wf = mapped(1, concurrency=Concurrency(TENANT_KEY, 1))
    run_id = run_list(repo, sql, [{"tenant": "a"}, {"tenant": "b"}], wf)
    sql.execute(  # both waiting, none admitted (as after a finish freed the map's slot)
        "UPDATE task_runs SET state = 'PENDING', ready_at = NULL WHERE map_id IS NOT NULL"
    )
    sql.execute("DELETE FROM outbox")
    named = queries.load()

    def admit(conn: psycopg.Connection[tuple[Any, ...]], key: str) -> int:
        """The admission pass's statements for one key, the transaction left open."""
        params: dict[str, Any] = {"ckeys": [key], "rkeys": [], "per_key": 100}
        conn.execute(
            named["lock_concurrency_keys"], {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": [key]}
        )
        maps = conn.execute(
            named["lock_admission_maps"], {"namespace": MAP_LOCK_NAMESPACE, "limit": 100}
        ).fetchall()
        row = conn.execute(named["admit_gated"], {**params, "maps": [m[0] for m in maps]})
        found = row.fetchone()
        return int(found[0]) if found else 0

    with psycopg.connect(clean_database_url) as first, psycopg.connect(clean_database_url) as b:
        assert admit(first, "t-a") == 1
        second: dict[str, int] = {}
        racer = threading.Thread(target=lambda: second.update(n=admit(b, "t-b")))
        racer.start()
        wait_for(
            lambda: waits_on_advisory_lock(sql, b.info.backend_pid),
            what="the second admission to wait for the map's lock",
        )
        first.commit()
        racer.join(timeout=30)
        assert not racer.is_alive()
        b.commit()
    assert second == {"n": 0}
    assert [r[1] for r in items(sql, run_id)] == ["READY", "PENDING"]


def test_a_rate_limited_map_never_starts_more_than_the_limit_in_a_window(
    repo: Store, sql: Sql
) -> None:
    limit = 3
    wf = mapped(rate_limit=RateLimit(limit, PER_S, "partner"))
    run_id = run_list(repo, sql, list(range(10)), wf)
    assert [r[1] for r in items(sql, run_id)].count("READY") == limit
    waiting = [r for r in items(sql, run_id) if r[1] == "PENDING"]
    assert repo.get_task(waiting[0][5]).waiting_on == "rate_limit"
    for _ in range(10):
        for tid, token in dispatch(sql):
            claim = repo.claim(tid, token, "w", 30.0).claim
            assert claim is not None
            assert repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED)
        drain(repo)
        # finished, the window still counts their starts: nothing more is admitted
        assert held(sql, "rate_key") == {}
        started = sql.execute(
            "SELECT count(*) FROM task_attempts WHERE rate_key = 'partner'"
            " AND started_at > now() - make_interval(secs => %s)",
            (PER_S,),
        ).fetchone()
        assert started is not None and started[0] <= limit
        if repo.get_task(task_ids(repo, run_id)["process"]).state is TaskState.SUCCEEDED:
            break
        # the window passes: every start so far moves out of it
        sql.execute(
            "UPDATE task_attempts SET started_at = started_at - make_interval(secs => %s)"
            " WHERE rate_key = 'partner'",
            (PER_S + 1,),
        )
        drain(repo)
    assert repo.get_task(task_ids(repo, run_id)["process"]).state is TaskState.SUCCEEDED
    starts = [
        r[0]
        for r in sql.execute(
            "SELECT started_at FROM task_attempts WHERE rate_key = 'partner' ORDER BY started_at"
        )
    ]
    assert len(starts) == 10
    most = max(
        sum(1 for s in starts if first <= s < first + timedelta(seconds=PER_S)) for first in starts
    )
    assert most == limit  # reached, never passed


def test_an_items_retry_waits_for_its_key_like_its_first_attempt(repo: Store, sql: Sql) -> None:
    limit = 2
    wf = mapped(concurrency=Concurrency(TENANT_KEY, limit), retry=NOW_RETRY)
    run_id = run_list(repo, sql, tenants(("a", 6), ("b", 3)), wf)

    def check() -> None:
        assert all(n <= limit for n in held(sql).values()), held(sql)

    work(repo, sql, check, fail_first=True)
    drain(repo)
    assert peaks(sql) == {"t-a": limit, "t-b": limit}
    attempts = sql.execute(
        "SELECT count(*), max(a.attempt) FROM task_attempts a JOIN task_runs t"
        " ON t.id = a.task_run_id WHERE t.map_id = %s",
        (task_ids(repo, run_id)["process"],),
    ).fetchone()
    assert attempts == (18, 2)  # each item failed once and succeeded on its second attempt
    assert repo.get_run(run_id).tasks[1].state is TaskState.SUCCEEDED


def test_a_due_retry_held_by_its_key_says_so_and_retry_now_is_admitted(
    repo: Store, sql: Sql
) -> None:
    slow = RetryPolicy(max_attempts=3, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)
    wf = mapped(concurrency=Concurrency("partner", 1), retry=slow)
    run_id = run_list(repo, sql, [1, 2], wf)
    first, second = (r[5] for r in items(sql, run_id))
    claim = claim_task(repo, sql, first)
    assert repo.finish(
        first, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    drain(repo)  # first → RETRYING (an hour away); its slot freed: second admitted
    assert repo.get_task(second).state is TaskState.READY
    done = repo.retry_task_now(first, "ops", "try again")
    assert done.task.state is TaskState.RETRYING  # due now, but the key's one slot is taken
    drain(repo)
    assert repo.get_task(first).waiting_on == "concurrency"
    claim = claim_task(repo, sql, second)
    assert repo.finish(second, claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    assert repo.get_task(first).state is TaskState.READY
    assert claim_task(repo, sql, first).attempt == 2


def test_cancelling_the_run_cancels_waiting_items_and_frees_their_keys(
    repo: Store, sql: Sql
) -> None:
    wf = mapped(concurrency=Concurrency(TENANT_KEY, 1))
    run_id = run_list(repo, sql, tenants(("a", 4), ("b", 4)), wf)
    ready = [r[5] for r in items(sql, run_id) if r[1] == "READY"]
    claim = claim_task(repo, sql, ready[0])
    sent = outbox(sql)
    repo.cancel_run(run_id)
    drain(repo)
    states = [r[1] for r in items(sql, run_id)]
    assert states.count("RUNNING") == 1 and states.count("CANCELLED") == 7
    assert repo.get_task(ready[0]).cancel_requested
    assert repo.finish(ready[0], claim.fencing_token, TaskState.CANCELLED)
    drain(repo)
    assert held(sql) == {} and outbox(sql) == sent  # nothing admitted behind a cancelled map
    assert repo.key_holds("t-a") == () and repo.key_holds("t-b") == ()
    run = repo.get_run(run_id)
    assert run.state is RunState.CANCELLED
    assert {t.name: t.state for t in run.tasks}["process"] is TaskState.CANCELLED


def test_keys_show_lists_the_items_holding_and_waiting_on_a_key(repo: Store, sql: Sql) -> None:
    wf = mapped(concurrency=Concurrency(TENANT_KEY, 2), rate_limit=RateLimit(3, PER_S, "partner"))
    run_id = run_list(repo, sql, [{"tenant": "a"}] * 5, wf)
    (first, *_) = [r[5] for r in items(sql, run_id) if r[1] == "READY"]
    claim_task(repo, sql, first)
    (hold,) = repo.key_holds("t-a")
    assert (hold.kind, hold.limit, hold.waiting) == (HoldKind.CONCURRENCY, 2, 3)
    assert sorted(t.name for t in hold.holders) == ["process[0]", "process[1]"]
    assert [t.name for t in hold.next] == ["process[2]", "process[3]", "process[4]"]
    assert {t.why for t in hold.next} == {"waits for a free slot of the key"}
    (rate,) = repo.key_holds("partner")
    assert rate.kind is HoldKind.RATE_LIMIT
    assert sorted(t.name for t in rate.holders) == ["process[0]", "process[1]"]


def test_an_item_that_cannot_fill_its_key_buries_the_map_with_no_item(
    repo: Store, sql: Sql
) -> None:
    wf = mapped(concurrency=Concurrency(TENANT_KEY, 2))
    run_id = run_list(repo, sql, [{"tenant": "a"}, {"name": "b"}], wf)
    process = repo.get_task(task_ids(repo, run_id)["process"])
    assert process.state is TaskState.DEAD
    assert process.failure_reason is FailureReason.ITEM_KEY_ERROR
    assert "item 1: concurrency.key" in (process.last_error or "")
    assert items(sql, run_id) == []


# ------------------------------------------------------------------ interfaces

KEYED_MAP = (
    "name: keyed_map\ntasks:\n"
    "  - {name: list, handler: e2e.items}\n"
    "  - name: process\n"
    "    handler: e2e.item\n"
    "    for_each: list\n"
    "    concurrency: {key: '{region}-{item[tenant]}', limit: 2}\n"
    "    rate_limit: {limit: 100, per: 1s, key: 'partner-{region}'}\n"
)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Path:
    directory = tmp_path_factory.mktemp("map-limits")
    return write_config(
        directory, database_url, {"k.yaml": KEYED_MAP}, handlers=["tests.e2e_handlers"]
    )


@pytest.fixture(scope="module")
def api(config: Path) -> Iterator[Api]:
    with serve_config(config) as running:
        yield running


@pytest.mark.parametrize(
    "run_input", [{}, {"tenant": "a"}], ids=["empty", "item-field-in-input-is-no-region"]
)
def test_a_trigger_whose_input_cannot_fill_a_map_key_is_refused_everywhere(
    api: Api, config: Path, sql: Sql, run_input: dict[str, Any]
) -> None:
    """The run-input part of a map's key is the same for every item: a trigger without it is
    refused on every path (a 400 JSON, one line and exit 2, an InputError), and no run exists."""
    fragment = "concurrency.key"
    reply = api.post("/api/v1/runs", {"workflow": "keyed_map", "input": run_input})
    assert fragment in assert_json_error(reply, 400)
    found = run_config(config, "trigger", "keyed_map", "--input", json.dumps(run_input))
    assert_refused(found, exitcodes.USAGE, fragment)
    with Client(load_config(config, env={})) as client, pytest.raises(InputError, match=fragment):
        client.trigger("keyed_map", run_input)
    row = sql.execute("SELECT count(*) FROM workflow_runs").fetchone()
    assert row == (0,)


def test_a_map_with_limits_validates_and_triggers(api: Api, config: Path, sql: Sql) -> None:
    found = run_config(config, "workflows", "validate")
    assert found.returncode == 0, found.stderr
    reply = api.post("/api/v1/runs", {"workflow": "keyed_map", "input": {"region": "eu"}})
    assert reply.status == 201, reply.body
    row = sql.execute(
        "SELECT concurrency_key, rate_key FROM task_runs WHERE name = 'process'"
    ).fetchone()
    assert row == (None, None)  # the map's row: its items will carry the keys


# ------------------------------------------------------------------ the admission pass at scale


def test_a_pass_over_a_keys_many_waiting_items_takes_only_what_the_limit_can_admit(
    repo: Store, sql: Sql, db: Database
) -> None:
    """A key with hundreds of waiting items: a pass admits its limit's worth, oldest first,
    and its candidates are those (never a lock on every waiting item); the engine's sessions
    compile no statement (JIT off: its estimates for such a pass cross jit_above_cost)."""
    wf = mapped(concurrency=Concurrency("partner", 4))
    run_id = run_list(repo, sql, list(range(600)), wf)
    ready = [r[0] for r in items(sql, run_id) if r[1] == "READY"]
    assert ready == [0, 1, 2, 3]
    named = queries.load()
    with db.transaction() as cur:  # rows are mappings
        cur.execute(
            b"EXPLAIN (ANALYZE, FORMAT JSON) " + named["admit_gated"],
            {"ckeys": ["partner"], "rkeys": [], "per_key": 100, "maps": []},
        )
        explained = cur.fetchone()
        cur.execute(b"SELECT current_setting('jit') AS jit")
        assert cur.fetchone() == {"jit": "off"}
    assert explained is not None
    plan = explained["QUERY PLAN"]
    locked = _node(plan[0]["Plan"], "LockRows")
    assert locked is not None and locked["Actual Rows"] == 4  # not 596 waiting items


def _node(plan: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The first plan node of ``kind`` (depth first), or None."""
    if plan.get("Node Type") == kind:
        return plan
    for child in plan.get("Plans", ()):
        found = _node(child, kind)
        if found is not None:
            return found
    return None
