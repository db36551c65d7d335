"""A circuit breaker per key (``circuit_breaker.key``, migration 0020) and retention of breaker
transitions, against real PostgreSQL.

Tasks of one handler with different rendered keys have different breakers: the failures of key
A's tasks open A's breaker and hold only A's tasks, while B's tasks run and SUCCEED. Every count
is read from the database.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.breakers import BreakerState, CircuitBreaker
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.model import ClaimOutcome
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import InputError, WrongStateError
from flowforge.store import queries
from tests.api_client import assert_json_error, serve_config, write_config
from tests.cli_runner import assert_ok
from tests.cli_runner import assert_refused as refused
from tests.cli_runner import run_config as flowforge
from tests.helpers import claim_task, dispatch, drain, outbox_token, task_ids, wait_for
from tests.integration.test_breakers import (
    HANDLER,
    NOW_RETRY,
    facts,
    fail,
    succeed,
    try_claim,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

KEYED = CircuitBreaker(failures=3, window=60.0, cooldown=30.0, key="partner-{region}")
DAY_S = 86_400.0


def keyed(name: str = "keyed", breaker: CircuitBreaker | None = KEYED) -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("call", HANDLER, retry=NOW_RETRY, circuit_breaker=breaker),))


def ready(repo: Store, region: str, runs: int, **workflow: Any) -> list[UUID]:
    """``runs`` READY tasks of :func:`keyed` for ``region``, oldest first."""
    ids = [repo.trigger(keyed(**workflow), {"region": region}).run_id for _ in range(runs)]
    return [repo.get_run(r).tasks[0].id for r in ids]


def breakers(sql: Sql) -> dict[str, tuple[str, UUID | None]]:
    """Every breaker row of HANDLER: key → (state, probe task)."""
    rows = sql.execute(
        "SELECT key, state, probe_task_id FROM breakers WHERE handler = %s", (HANDLER,)
    ).fetchall()
    return {str(k): (str(s), p) for k, s, p in rows}


def transitions(sql: Sql) -> list[tuple[str, str, str, str]]:
    rows = sql.execute(
        "SELECT key, from_state, to_state, cause FROM breaker_transitions ORDER BY id"
    ).fetchall()
    return [(str(k), str(a), str(b), str(c)) for k, a, b, c in rows]


def states(sql: Sql, ids: list[UUID]) -> list[str]:
    rows = sql.execute(
        "SELECT state FROM task_runs WHERE id = ANY(%s) ORDER BY seq", (ids,)
    ).fetchall()
    return [str(r[0]) for r in rows]


def cooldown_over(sql: Sql, key: str) -> None:
    sql.execute(
        "UPDATE breakers SET opened_at = opened_at - interval '1 hour' WHERE key = %s", (key,)
    )


def open_key(repo: Store, sql: Sql, region: str, extra: int) -> list[UUID]:
    """Three failures of ``region``'s tasks open its breaker; ``extra`` more READY tasks."""
    tasks = ready(repo, region, 3 + extra)
    for tid in tasks[:3]:
        fail(repo, sql, tid)
    assert breakers(sql)[f"partner-{region}"][0] == "open"
    return tasks[3:]


def test_one_keys_failures_open_its_breaker_only_and_the_other_keys_tasks_succeed(
    repo: Store, sql: Sql
) -> None:
    eu_waiting = open_key(repo, sql, "eu", extra=2)
    us = ready(repo, "us", 4)
    unkeyed = [repo.get_run(repo.trigger(keyed("plain", None)).run_id).tasks[0].id]
    rows = sql.execute(
        "SELECT breaker_key FROM task_runs WHERE id = ANY(%s)", (eu_waiting + us + unkeyed,)
    ).fetchall()
    assert sorted(r[0] or "" for r in rows) == ["", *["partner-eu"] * 2, *["partner-us"] * 4]
    # eu's tasks are parked (no attempt used); us's and the unkeyed one run meanwhile
    for tid in eu_waiting:
        assert try_claim(repo, sql, tid) is ClaimOutcome.LOST
        assert facts(sql, tid) == ("RETRYING", 0, "circuit_open", False, 0)
        assert repo.get_task(tid).waiting_on == "circuit_open"
    for tid in us + unkeyed:
        succeed(repo, sql, tid)
    assert states(sql, us + unkeyed) == ["SUCCEEDED"] * 5
    # one failure of us's counts against us's breaker only
    fail(repo, sql, ready(repo, "us", 1)[0])
    assert breakers(sql) == {"partner-eu": ("open", None), "partner-us": ("closed", None)}
    assert transitions(sql) == [("partner-eu", "closed", "open", "failures")]
    drain(repo)  # eu's cooldown runs: still parked, nothing else moved
    assert states(sql, eu_waiting) == ["RETRYING", "RETRYING"]
    shown = {b.key: b for b in repo.breakers(HANDLER)}
    assert (shown["partner-eu"].state, shown["partner-eu"].parked) == (BreakerState.OPEN, 2)
    assert (shown["partner-us"].recent_failures, shown["partner-us"].parked) == (1, 0)


def test_each_key_probes_on_its_own_cooldown(repo: Store, sql: Sql) -> None:
    eu = open_key(repo, sql, "eu", extra=2)
    us = open_key(repo, sql, "us", extra=1)
    for tid in eu + us:
        assert try_claim(repo, sql, tid) is ClaimOutcome.LOST
    cooldown_over(sql, "partner-eu")
    drain(repo)
    # eu's oldest parked task is its probe; us's breaker, cooldown running, has none
    assert breakers(sql) == {"partner-eu": ("half_open", eu[0]), "partner-us": ("open", None)}
    succeed(repo, sql, eu[0])
    drain(repo)
    assert breakers(sql)["partner-eu"] == ("closed", None)
    succeed(repo, sql, eu[1])  # unparked by the closing
    assert facts(sql, us[0]) == ("RETRYING", 0, "circuit_open", False, 0)  # us still held
    # us's probe fails: us opens again for a fresh cooldown, eu stays closed
    cooldown_over(sql, "partner-us")
    drain(repo)
    assert breakers(sql)["partner-us"] == ("half_open", us[0])
    fail(repo, sql, us[0])
    assert breakers(sql) == {"partner-eu": ("closed", None), "partner-us": ("open", None)}
    assert [t for t in transitions(sql) if t[0] == "partner-us"][-1] == (
        "partner-us",
        "half_open",
        "open",
        "probe_failed",
    )


def plain_task(repo: Store) -> UUID:
    """A READY task of HANDLER that declares no breaker key."""
    return repo.get_run(repo.trigger(keyed("plain", None)).run_id).tasks[0].id


def test_an_operator_opens_and_closes_one_keys_breaker(repo: Store, sql: Sql) -> None:
    eu, us = ready(repo, "eu", 2), ready(repo, "us", 2)
    plain = [plain_task(repo), plain_task(repo)]
    done = repo.open_breaker(HANDLER, "ann", "region down", key="partner-us")
    assert (done.key, done.previous_state, done.new_state) == ("partner-us", "closed", "open")
    assert try_claim(repo, sql, us[0]) is ClaimOutcome.LOST
    succeed(repo, sql, eu[0])  # another key and the handler's unkeyed tasks are not held
    succeed(repo, sql, plain[0])
    # the handler's own breaker holds its unkeyed tasks only, not a keyed one
    repo.open_breaker(HANDLER, "ann", None)
    assert try_claim(repo, sql, plain[1]) is ClaimOutcome.LOST
    succeed(repo, sql, eu[1])
    repo.close_breaker(HANDLER, "ann", None)
    with pytest.raises(WrongStateError, match="key 'partner-us' is held open already"):
        repo.open_breaker(HANDLER, "ann", None, key="partner-us")
    with pytest.raises(InputError, match="empty"):
        repo.close_breaker(HANDLER, "ann", None, key="")
    assert [b.key for b in repo.breakers(HANDLER, "partner-us")] == ["partner-us"]
    closed = repo.close_breaker(HANDLER, "bob", "back", key="partner-us")
    assert (closed.key, closed.previous_state) == ("partner-us", "open")
    with pytest.raises(WrongStateError, match="closed already"):
        repo.close_breaker(HANDLER, "bob", None, key="partner-us")
    drain(repo)
    succeed(repo, sql, us[0])  # unparked by the close
    succeed(repo, sql, us[1])
    succeed(repo, sql, plain[1])
    assert states(sql, eu + us + plain) == ["SUCCEEDED"] * 6
    audit = sql.execute("SELECT action, key FROM gate_audit ORDER BY id").fetchall()
    assert audit == [
        ("breaker_open", "partner-us"),
        ("breaker_open", None),
        ("breaker_close", None),
        ("breaker_close", "partner-us"),
    ]
    details = sql.execute(
        "SELECT details FROM operator_actions WHERE source = 'gate_audit' ORDER BY id"
    ).fetchall()
    assert details[0][0] == {"scope": "handler", "name": HANDLER, "key": "partner-us"}
    assert details[1][0] == {"scope": "handler", "name": HANDLER}


def test_a_maps_items_render_their_breaker_key_per_item(repo: Store, sql: Sql) -> None:
    breaker = CircuitBreaker(3, 60, 30, key="partner-{item[region]}")
    wf = WorkflowDef(
        "mapped_keyed",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", HANDLER, for_each="list", circuit_breaker=breaker),
        ),
    )
    run_id = repo.trigger(wf, {}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    result = [{"region": "eu"}, {"region": "us"}]
    assert repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=result)
    dispatch(sql)
    drain(repo)
    rows = sql.execute(
        "SELECT name, breaker_key, breaker_failures FROM task_runs WHERE run_id = %s ORDER BY name",
        (run_id,),
    ).fetchall()
    assert rows == [
        ("list", None, None),
        ("process", None, 3),
        ("process[0]", "partner-eu", 3),
        ("process[1]", "partner-us", 3),
    ]


def test_a_child_runs_tasks_render_their_key_from_the_child_input(repo: Store, sql: Sql) -> None:
    repo.register_workflows([keyed("child_keyed")])
    parent = WorkflowDef(
        "parent_keyed",
        (TaskDef("start", workflow="child_keyed", input={"region": "{zone}"}),),
    )
    run_id = repo.trigger(parent, {"zone": "ap"}).run_id
    drain(repo)
    row = sql.execute(
        "SELECT c.breaker_key FROM task_runs c JOIN workflow_runs r ON r.id = c.run_id"
        " WHERE r.parent_run_id = %s",
        (run_id,),
    ).fetchone()
    assert row == ("partner-ap",)


def test_a_trigger_whose_key_cannot_render_is_refused_and_creates_nothing(
    repo: Store, sql: Sql
) -> None:
    with pytest.raises(InputError, match=r"circuit_breaker\.key"):
        repo.trigger(keyed(), {"zone": "eu"})  # no region
    empty = CircuitBreaker(3, 60, 30, key="{region}")
    with pytest.raises(InputError, match="empty"):
        repo.trigger(keyed("empty", empty), {"region": ""})  # '' is the handler's breaker
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


def test_retention_deletes_old_logged_transitions_only_and_counts_stay(
    repo: Store, sql: Sql
) -> None:
    eu = open_key(repo, sql, "eu", extra=1)
    repo.close_breaker(HANDLER, "ann", None, key="partner-eu")
    drain(repo)  # the scheduler's gate pass logs (and marks) both transitions
    repo.open_breaker(HANDLER, "ann", None, key="partner-us")  # not logged yet
    assert sql.execute("SELECT count(*) FROM breaker_transitions WHERE NOT logged").fetchone() == (
        1,
    )
    counted = {b.key: b.transitions for b in repo.breakers(HANDLER)}
    gauges = {g.key: g.transitions for g in repo.gauges().breakers}
    sql.execute("UPDATE breaker_transitions SET at = at - interval '40 days'")
    sql.execute("UPDATE gate_audit SET requested_at = requested_at - interval '40 days'")
    recent = repo.open_breaker(HANDLER, "ann", "recent", key="partner-eu")  # a new audit row
    assert recent.new_state == "open"
    # bounded per pass: a limit of 1 deletes one transition and one audit row
    assert repo.purge(30 * DAY_S, 1) == 2
    assert repo.purge(30 * DAY_S, 100) == 2  # the other logged transition, one audit row
    assert repo.purge(30 * DAY_S, 100) == 0
    left = sql.execute(
        "SELECT key, to_state, logged FROM breaker_transitions ORDER BY id"
    ).fetchall()
    # the unlogged old one is kept; so is the recent opening (logged or not)
    assert left == [("partner-us", "open", False), ("partner-eu", "open", False)]
    assert sql.execute("SELECT action, reason FROM gate_audit").fetchall() == [
        ("breaker_open", "recent")
    ]
    # the counts the CLI and /metrics show never go down (plus the recent opening of eu)
    after = {b.key: b.transitions for b in repo.breakers(HANDLER)}
    assert after == {"partner-eu": counted["partner-eu"] + 1, "partner-us": 1}
    moved = {g.key: g.transitions for g in repo.gauges().breakers}
    assert moved["partner-eu"][BreakerState.CLOSED] == gauges["partner-eu"][BreakerState.CLOSED]
    assert moved["partner-eu"][BreakerState.OPEN] == gauges["partner-eu"][BreakerState.OPEN] + 1
    assert eu  # its task stayed parked throughout (held open again)
    assert try_claim(repo, sql, eu[0]) is ClaimOutcome.LOST


def counter(repo: Store) -> dict[tuple[str, BreakerState], int]:
    """/metrics' transition counter as the api sums it: per handler and state entered, over
    its breakers' rows and the counts of keyed rows retention deleted."""
    gauges = repo.gauges()
    totals = dict(gauges.folded)
    for gauge in gauges.breakers:
        for state, n in gauge.transitions.items():
            totals[gauge.handler, state] = totals.get((gauge.handler, state), 0) + n
    return {k: n for k, n in totals.items() if n}


def test_retention_deletes_idle_closed_keyed_breakers_only_in_batches(
    repo: Store, sql: Sql
) -> None:
    """A keyed breaker closed, with no failure in its window, unchanged for the retention time
    and its transitions gone is deleted (it reads as no row), a batch at a time; the handler's
    own, one held open, one failing within its window, one changed lately and one with a
    transition not logged yet are kept; /metrics' counter does not go down."""
    open_key(repo, sql, "eu", extra=0)
    repo.close_breaker(HANDLER, "ann", None, key="partner-eu")  # opened, closed: 2 transitions
    for region in ("ap", "us", "ca"):  # one failure each: a closed row, no transition
        fail(repo, sql, ready(repo, region, 1)[0])
    fail(repo, sql, ready(repo, "-", 1, breaker=CircuitBreaker(3, 60, 30))[0])  # key ''
    repo.open_breaker(HANDLER, "ann", None, key="partner-held")
    drain(repo)  # logs (and marks) every transition so far
    repo.open_breaker(HANDLER, "ann", None, key="partner-sa")
    repo.close_breaker(HANDLER, "ann", None, key="partner-sa")  # its transitions not logged
    before = counter(repo)
    assert before[HANDLER, BreakerState.OPEN] == 3, transitions(sql)
    assert before[HANDLER, BreakerState.CLOSED] == 2
    old = "now() - interval '40 days'"
    sql.execute(f"UPDATE breaker_transitions SET at = {old}")
    sql.execute(f"UPDATE breakers SET updated_at = {old}")  # every row idle ...
    sql.execute(  # ... and every failure out of its window, but us's
        f"UPDATE breakers SET failures = ARRAY[{old}]"
        " WHERE cardinality(failures) > 0 AND key <> 'partner-us'"
    )
    sql.execute("UPDATE breakers SET updated_at = now() WHERE key = 'partner-ca'")  # lately
    rows: list[int] = []
    for _ in range(5):
        repo.purge(30 * DAY_S, 1)
        rows.append(len(breakers(sql)))
    # at most one a pass (eu's goes once the passes took its two transitions, one a pass)
    assert all(0 <= a - b <= 1 for a, b in zip([7, *rows], rows, strict=False)) and rows[-1] == 5
    assert sorted(breakers(sql)) == ["", "partner-ca", "partner-held", "partner-sa", "partner-us"]
    # the deleted keys keep nothing: held's purged transition stays counted under its row
    kept = sql.execute("SELECT DISTINCT key FROM breaker_transitions_purged").fetchall()
    assert kept == [("partner-held",)]
    assert counter(repo) == before  # eu's two transitions are its handler's now
    assert repo.gauges().folded == {
        (HANDLER, BreakerState.OPEN): 1,
        (HANDLER, BreakerState.CLOSED): 1,
    }
    # a deleted key that fails again starts afresh: one failure, closed, its own row
    fail(repo, sql, ready(repo, "ap", 1)[0])
    row = sql.execute(
        "SELECT state, cardinality(failures) FROM breakers WHERE key = 'partner-ap'"
    ).fetchone()
    assert row == ("closed", 1)


def test_retention_skips_a_breaker_being_written_and_a_failure_after_it_starts_afresh(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """A finish counting a failure holds the breaker row's lock: retention skips the row. The
    other order, forced: retention's delete uncommitted while a key fails three times — the
    failure waits, then inserts a fresh row (ON CONFLICT finds the old one gone) and opens it."""
    fail(repo, sql, ready(repo, "eu", 1)[0])
    fail(repo, sql, ready(repo, "us", 1)[0])
    sql.execute("UPDATE breakers SET updated_at = now() - interval '40 days', failures = '{}'")
    named = queries.load()
    with psycopg.connect(clean_database_url) as writer:  # as trip_breakers' ON CONFLICT would
        writer.execute("SELECT 1 FROM breakers WHERE key = 'partner-eu' FOR UPDATE")
        repo.purge(30 * DAY_S, 100)
        assert sorted(breakers(sql)) == ["partner-eu"]  # us deleted, eu skipped
    with psycopg.connect(clean_database_url) as purger:
        found = purger.execute(named["purge_idle_breakers"], {"age_s": 30 * DAY_S, "limit": 10})
        assert found.rowcount == 1
        tasks = ready(repo, "eu", 3)
        claims = [claim_task(repo, sql, tid) for tid in tasks]
        finisher = threading.Thread(
            target=lambda: [
                repo.finish(
                    t,
                    c.fencing_token,
                    TaskState.FAILED,
                    reason=FailureReason.HANDLER_ERROR,
                    error="x",
                )
                for t, c in zip(tasks, claims, strict=True)
            ]
        )
        finisher.start()
        wait_for(lambda: waits_on_lock(sql), what="the failure to wait for the delete")
        purger.commit()
        finisher.join(timeout=30)
        assert not finisher.is_alive()
    assert breakers(sql)["partner-eu"][0] == "open"  # three fresh failures, counted
    assert sql.execute(
        "SELECT cardinality(failures) FROM breakers WHERE key = 'partner-eu'"
    ).fetchone() == (3,)


COUNTED = FailureReason.HANDLER_ERROR


def waits_on_lock(sql: Sql) -> bool:
    """Whether another session of this database waits on a row (tuple or transaction) lock."""
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
    ).fetchone()
    return row is not None and row[0] > 0


# ------------------------------------------------------------------ the CLI, the api, /metrics


@pytest.fixture
def config(tmp_path: Path, clean_database_url: str) -> Path:
    return write_config(tmp_path, clean_database_url, {})


def test_cli_lists_opens_and_closes_one_keys_breaker(config: Path, repo: Store, sql: Sql) -> None:
    open_key(repo, sql, "eu", extra=0)
    us = ready(repo, "us", 1)
    out = assert_ok(flowforge(config, "breakers", "list"))
    header, row = out.splitlines()[:2]
    assert header.split()[:3] == ["HANDLER", "KEY", "STATE"]
    assert row.split()[:3] == [HANDLER, "partner-eu", "open"]
    out = assert_ok(
        flowforge(config, "breakers", "open", HANDLER, "--key", "partner-us", "--by", "ann")
    )
    assert out == f"breaker of handler '{HANDLER}' key 'partner-us': closed -> open\n"
    assert try_claim(repo, sql, us[0]) is ClaimOutcome.LOST
    (shown,) = json.loads(
        assert_ok(flowforge(config, "breakers", "list", "--key", "partner-us", "--json"))
    )["breakers"]
    assert (shown["key"], shown["state"], shown["held"], shown["parked"]) == (
        "partner-us",
        "open",
        True,
        1,
    )
    data = json.loads(
        assert_ok(flowforge(config, "breakers", "close", HANDLER, "--key", "partner-us", "--json"))
    )
    assert (data["key"], data["previous_state"], data["new_state"]) == (
        "partner-us",
        "open",
        "closed",
    )
    refused(
        flowforge(config, "breakers", "close", HANDLER, "--key", "partner-us"),
        exitcodes.REFUSED,
        "key 'partner-us' is closed already",
    )
    refused(flowforge(config, "breakers", "open", HANDLER, "--key", ""), exitcodes.USAGE, "empty")
    refused(flowforge(config, "breakers", "list", HANDLER, "--key", ""), exitcodes.USAGE, "--key")
    refused(
        flowforge(config, "breakers", "open", "no.such", "--key", "k"),
        exitcodes.NOT_FOUND,
        "no workflow",
    )
    refused(
        flowforge(config, "breakers", "open", HANDLER, "--key", "a\udcffb"),
        exitcodes.USAGE,
        "--key",
    )
    assert sql.execute("SELECT action, key FROM gate_audit ORDER BY id").fetchall() == [
        ("breaker_open", "partner-us"),
        ("breaker_close", "partner-us"),
    ]


def test_api_names_a_keyed_breaker_by_its_query_parameter(
    config: Path, repo: Store, sql: Sql
) -> None:
    us = ready(repo, "us", 1)
    path = f"/api/v1/breakers/{HANDLER}"
    with serve_config(config) as api:
        reply = api.post(f"{path}/open?key=partner-us", {"reason": "region down"})
        assert reply.status == 200, reply.body
        assert reply.json() == {
            "action": "breaker_open",
            "scope": "handler",
            "name": HANDLER,
            "key": "partner-us",
            "previous_state": "closed",
            "new_state": "open",
        }
        assert try_claim(repo, sql, us[0]) is ClaimOutcome.LOST
        (shown,) = api.get("/api/v1/breakers?key=partner-us").json()["breakers"]
        assert (shown["key"], shown["parked"]) == ("partner-us", 1)
        assert api.get("/api/v1/breakers?key=other").json() == {"breakers": []}
        assert api.get(f"/api/v1/breakers?handler={HANDLER}").json()["breakers"] == [shown]
        assert "empty" in assert_json_error(api.post(f"{path}/open?key="), 400)
        assert_json_error(api.post(f"{path}/close?key=a%00b"), 400)
        assert_json_error(api.get("/api/v1/breakers?key="), 400)
        assert_json_error(api.get("/api/v1/breakers?handler=bad%20name"), 400)
        assert_json_error(api.post("/api/v1/breakers/no.such/open?key=k"), 404)
        assert "closed already" in assert_json_error(api.post(f"{path}/close"), 409)
        text = api.get("/metrics").body.decode()
        assert f'flowforge_breaker_state{{handler="{HANDLER}",key="partner-us"}} 2.0' in text
        assert f'flowforge_breakers_keyed_not_closed{{handler="{HANDLER}"}} 1.0' in text
        assert api.post(f"{path}/close?key=partner-us").status == 200
        text = api.get("/metrics").body.decode()
        assert 'key="partner-us"' not in text  # closed: its series is gone
    assert sql.execute("SELECT count(*) FROM gate_audit").fetchone() == (2,)


def test_a_tasks_keys_are_in_its_json_everywhere(config: Path, repo: Store, sql: Sql) -> None:
    """A task's rendered keys — concurrency, rate and breaker — in the store's task and run
    reads, `flowforge status RUN --json` and the api's task and run JSON (null without)."""
    wf = WorkflowDef(
        "all-keys",
        (
            TaskDef(
                "call",
                HANDLER,
                concurrency=Concurrency("t-{region}", 2),
                rate_limit=RateLimit(10, 1.0, "r-{region}"),
                circuit_breaker=KEYED,
            ),
            TaskDef("plain", HANDLER, depends_on=("call",)),
        ),
    )
    run_id = repo.trigger(wf, {"region": "eu"}).run_id
    ids = task_ids(repo, run_id)
    want = {
        "concurrency_key": "t-eu",
        "concurrency_limit": 2,
        "rate_key": "r-eu",
        "rate_limit": 10,
        "rate_per_s": 1.0,
        "breaker_key": "partner-eu",
    }
    none = dict.fromkeys(want)

    def keys(task: dict[str, Any]) -> dict[str, Any]:
        return {k: task[k] for k in want}

    task = repo.get_task(ids["call"])
    assert (task.concurrency_key, task.rate_key, task.breaker_key) == ("t-eu", "r-eu", "partner-eu")
    by_name = {t.name: t for t in repo.get_run(run_id).tasks}
    assert (by_name["call"].breaker_key, by_name["plain"].breaker_key) == ("partner-eu", None)
    status = json.loads(assert_ok(flowforge(config, "status", str(run_id), "--json")))
    shown = {t["name"]: keys(t) for t in status["tasks"]}
    assert shown == {"call": want, "plain": none}
    with serve_config(config) as api:
        assert keys(api.get(f"/api/v1/task-runs/{ids['call']}").json()["task"]) == want
        assert keys(api.get(f"/api/v1/task-runs/{ids['plain']}").json()["task"]) == none
        tasks = api.get(f"/api/v1/runs/{run_id}").json()["tasks"]
        assert {t["name"]: keys(t) for t in tasks} == {"call": want, "plain": none}


def claim_counting_gates(sql: Sql, tids: list[UUID]) -> tuple[int, int]:
    """Run the claim of ``tids`` in a transaction rolled back: (tasks claimed, calls of
    flowforge_gate it made), the calls counted by PostgreSQL (track_functions)."""
    tokens = [outbox_token(sql, t) for t in tids]
    params = {
        "ids": tids,
        "tokens": tokens,
        "worker": "w",
        "lease_s": 30.0,
        "keyless_only": False,
        "local": False,
        "inline": 1000,  # worker.upstream_inline_items
    }
    counted: tuple[int, int] = (0, 0)
    with sql.transaction(force_rollback=True):
        sql.execute("SET LOCAL track_functions = 'pl'")
        claimed = len(sql.execute(queries.load()["claim"], params).fetchall())
        row = sql.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname = 'flowforge_gate'"
        ).fetchone()
        assert row is not None
        counted = (claimed, int(row[0]))
    return counted


def test_the_claim_of_a_task_nothing_holds_calls_no_gate_keyed_or_not(
    repo: Store, sql: Sql
) -> None:
    eu = ready(repo, "eu", 3)
    plain = [plain_task(repo)]
    # nothing held: the InitPlan (flowforge_gates_closed) answers once, no task's gate is read
    assert claim_counting_gates(sql, eu + plain) == (4, 0)
    # another key's breaker open: each task's gate is read, and its own key lets it through
    repo.open_breaker(HANDLER, "ann", None, key="partner-us")
    assert claim_counting_gates(sql, eu + plain) == (4, 4)
    repo.open_breaker(HANDLER, "ann", None, key="partner-eu")
    assert claim_counting_gates(sql, eu + plain)[0] == 1  # eu's are held now
