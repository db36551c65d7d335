"""The run page's timeline (``GET /api/v1/runs/{id}/timeline``) against real PostgreSQL.

A run is driven statement by statement through the repository (as test_maps_api.py does): a
task that fails once and succeeds on its retry, a map of 25 items, a task after it. Proven
here: one row per task in creation order, a map's first 20 items under it and one row counting
the rest; one segment per attempt with its outcome, reason and the first line of its error as
the database holds it; the backoff between the two attempts and the wait before the first; a
running attempt open at the database's now; the store's bounds (tasks, items, items in all,
attempts) each counted, never dropped silently; a malformed id 400, an unknown run 404.
``Client.timeline``, its Python twin, reads the same facts the api lays out.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge import Client, TimelineFacts, TimelineLimits
from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InvalidIdError, NotFoundError
from tests.api_client import UNKNOWN_ID, Api, StartApi, assert_json_error, assert_json_ok
from tests.helpers import FAST_RETRY, claim_task, dispatch, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "flowforge.example.yaml"
ITEMS = 25
#: Untrusted text in an error: the api returns it as is (the page shows it as text).
ERROR = '<img src=x onerror=alert(1)> went wrong\n  File "x.py", line 1'
TIMELINE = WorkflowDef(
    "timeline",
    (
        TaskDef("flaky", "tests.noop", retry=FAST_RETRY),
        TaskDef("list", "tests.noop", depends_on=("flaky",)),
        TaskDef("process", "tests.noop", for_each="list"),
        TaskDef("merge", "tests.noop", depends_on=("process",)),
    ),
)


@pytest.fixture
def api(api_here: StartApi) -> Api:
    return api_here()


def timeline(api: Api, run_id: UUID | str) -> dict[str, Any]:
    return assert_json_ok(api.get(f"/api/v1/runs/{run_id}/timeline"))  # type: ignore[no-any-return]


def retried_then_mapped(repo: Store, sql: Sql) -> tuple[UUID, dict[str, UUID]]:
    """flaky fails once (ERROR) and succeeds on its retry, list returns ITEMS items, the map
    expands; item 0 succeeds, item 1 is claimed and left running."""
    run_id = repo.trigger(TIMELINE, {}).run_id
    ids = task_ids(repo, run_id)
    first = claim_task(repo, sql, ids["flaky"], worker="w-1")
    repo.finish(
        ids["flaky"],
        first.fencing_token,
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error=ERROR,
    )
    drain(repo)  # FAILED -> RETRYING (no delay) -> READY
    second = claim_task(repo, sql, ids["flaky"], worker="w-2")
    repo.finish(ids["flaky"], second.fencing_token, TaskState.SUCCEEDED, result=None)
    drain(repo)
    listed = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], listed.fencing_token, TaskState.SUCCEEDED, result=list(range(ITEMS)))
    drain(repo)
    tokens = dict(dispatch(sql))
    items = sql.execute(
        "SELECT id FROM task_runs WHERE map_id = %s AND item_index < 2 ORDER BY item_index",
        (ids["process"],),
    ).fetchall()
    done = repo.claim(items[0][0], tokens[items[0][0]], "w-1", 30.0).claim
    assert done is not None
    repo.finish(items[0][0], done.fencing_token, TaskState.SUCCEEDED, result=0)
    assert repo.claim(items[1][0], tokens[items[1][0]], "w-2", 30.0).claim is not None
    return run_id, ids


def attempt_rows(sql: Sql, task_run_id: UUID) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT attempt, started_at, finished_at, outcome, failure_reason, worker"
        " FROM task_attempts WHERE task_run_id = %s ORDER BY attempt",
        (task_run_id,),
    ).fetchall()


def instant(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


def test_the_timeline_shows_each_attempt_the_retry_and_the_map_bounded(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id, ids = retried_then_mapped(repo, sql)
    data = timeline(api, run_id)
    rows = data["rows"]
    assert [(r["kind"], r["name"]) for r in rows[:3]] == [
        ("task", "flaky"),
        ("task", "list"),
        ("task", "process"),
    ]
    # the map's first 20 items in item order under it, one row for the 5 others, then merge
    items = rows[3:23]
    assert [(r["kind"], r["name"], r["depth"]) for r in items] == [
        ("item", f"process[{i}]", 1) for i in range(20)
    ]
    assert {r["map_id"] for r in items} == {str(ids["process"])}
    more = rows[23]
    assert (more["kind"], more["n"], more["counts"]) == ("more", ITEMS - 20, {"READY": 5})
    assert more["label"] == "+ 5 more items" and more["segments"] == []  # none started
    assert [(r["kind"], r["name"]) for r in rows[24:]] == [("task", "merge")]
    assert data["tasks_total"] == 4

    # flaky: the wait before its first attempt, attempt 1 failed, the backoff, attempt 2
    flaky = rows[0]
    assert flaky["attempts"] == 2 and flaky["attempts_omitted"] == 0
    assert flaky["state"] == "SUCCEEDED"
    kinds = [(s["kind"], s["attempt"], s["outcome"]) for s in flaky["segments"]]
    assert kinds == [
        ("wait", None, None),
        ("attempt", 1, "failed"),
        ("backoff", None, None),
        ("attempt", 2, "succeeded"),
    ]
    stored = attempt_rows(sql, ids["flaky"])
    wait, one, backoff, two = flaky["segments"]
    assert instant(one["start"]) == stored[0][1] and instant(one["end"]) == stored[0][2]
    assert instant(two["start"]) == stored[1][1] and instant(two["end"]) == stored[1][2]
    assert (one["failure_reason"], one["worker"]) == ("handler_error", "w-1")
    assert two["worker"] == "w-2" and two["error"] is None
    assert one["error"] == "<img src=x onerror=alert(1)> went wrong"  # its first line only
    assert (backoff["start"], backoff["end"]) == (one["end"], two["start"])
    assert instant(backoff["end"]) > instant(backoff["start"])
    assert wait["end"] == one["start"] and not any(s["open"] for s in flaky["segments"])
    # seconds from the axis start, in order, within the axis
    starts = [s["start_s"] for s in flaky["segments"]]
    assert starts == sorted(starts) and starts[0] >= 0
    assert all(s["end_s"] <= data["span_s"] for r in rows for s in r["segments"])

    # list could start when flaky finished: its wait starts at flaky's last finish
    listed = rows[1]["segments"]
    assert [s["kind"] for s in listed] == ["wait", "attempt"]
    assert listed[0]["start"] == two["end"]
    # the map: a wait, then one span from its expansion, open (still running)
    process = rows[2]
    assert process["task_kind"] == "map" and process["state"] == "RUNNING"
    assert [(s["kind"], s["open"]) for s in process["segments"]][-1] == ("span", True)
    # item 1 runs: its attempt is open and ends at the database's now, as the axis does
    running = rows[4]["segments"][-1]
    assert (running["kind"], running["outcome"], running["open"]) == ("attempt", "running", True)
    assert running["end"] == data["now"] == data["end"]
    assert rows[3]["segments"][-1]["outcome"] == "succeeded"
    # merge waits for the map: no segment yet
    assert rows[-1]["segments"] == [] and rows[-1]["state"] == "PENDING"
    assert data["run"]["id"] == str(run_id) and data["run"]["state"] == "RUNNING"
    assert data["ticks"][0] == {"s": 0.0, "label": "0s"}


def test_a_later_read_grows_the_running_bar(api: Api, repo: Store, sql: Sql) -> None:
    run_id, _ = retried_then_mapped(repo, sql)
    before = timeline(api, run_id)["rows"][4]["segments"][-1]
    sql.execute("SELECT pg_sleep(0.05)")
    after = timeline(api, run_id)["rows"][4]["segments"][-1]
    assert after["start"] == before["start"] and after["open"]
    assert instant(after["end"]) > instant(before["end"])


def test_the_store_bounds_tasks_items_and_attempts_and_counts_what_it_leaves_out(
    repo: Store, sql: Sql
) -> None:
    run_id, ids = retried_then_mapped(repo, sql)
    few = repo.timeline(run_id, TimelineLimits(tasks=3, items=4, item_rows=3, attempts=1))
    assert [t.name for t in few.tasks] == [
        "flaky",
        "list",
        "process",
        "process[0]",
        "process[1]",
        "process[2]",
    ]
    assert few.tasks_total == 4  # merge is left out, counted
    (rest,) = few.rests
    assert (rest.map_id, rest.n) == (ids["process"], ITEMS - 3)  # from item 3 on
    assert rest.counts == {"READY": ITEMS - 3} and rest.unfinished_started == 0
    flaky = few.tasks[0]
    assert [a.attempt for a in flaky.attempts] == [2]  # the latest
    assert flaky.attempt == 2 and flaky.attempts[0].traceback is None
    whole = repo.timeline(run_id, TimelineLimits())
    assert len(whole.tasks) == 4 + 20 and whole.tasks_total == 4
    assert whole.rests[0].n == ITEMS - 20
    assert [a.attempt for a in whole.tasks[0].attempts] == [1, 2]
    assert whole.tasks[0].attempts[0].error == ERROR


def test_a_rest_counts_started_items_and_spans_their_times(repo: Store, sql: Sql) -> None:
    run_id, ids = retried_then_mapped(repo, sql)
    few = repo.timeline(run_id, TimelineLimits(items=1))
    (rest,) = few.rests
    assert rest.n == ITEMS - 1 and rest.counts == {"RUNNING": 1, "READY": ITEMS - 2}
    assert rest.unfinished_started == 1 and rest.attempts == 1
    started = sql.execute(
        "SELECT started_at FROM task_runs WHERE map_id = %s AND item_index = 1",
        (ids["process"],),
    ).fetchone()
    assert started is not None and rest.first_started_at == started[0]
    assert rest.last_finished_at is None


@pytest.mark.parametrize("bad", ["nope", "1234", "%00", "00000000-0000-0000-0000-00000000000g"])
def test_a_malformed_run_id_is_a_400(api: Api, bad: str) -> None:
    assert "run id" in assert_json_error(api.get(f"/api/v1/runs/{bad}/timeline"), 400)


def test_an_unknown_run_is_a_404(api: Api, repo: Store) -> None:
    message = assert_json_error(api.get(f"/api/v1/runs/{UNKNOWN_ID}/timeline"), 404)
    assert UNKNOWN_ID in message


def test_reads_need_the_token(api: Api, repo: Store) -> None:
    reply = api.request("GET", f"/api/v1/runs/{UNKNOWN_ID}/timeline", auth=False)
    assert_json_error(reply, 401)


def test_the_client_reads_the_facts_the_api_lays_out(
    api: Api, repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id, ids = retried_then_mapped(repo, sql)
    config = load_config(EXAMPLE, env={"FLOWFORGE_DATABASE_URL": clean_database_url})
    with Client(config) as client:
        facts = client.timeline(run_id)
        few = client.timeline(str(run_id), TimelineLimits(tasks=2, attempts=1))
        with pytest.raises(NotFoundError, match=UNKNOWN_ID):
            client.timeline(UNKNOWN_ID)
        with pytest.raises(InvalidIdError, match="run id"):
            client.timeline("nope")
    data = timeline(api, run_id)
    assert isinstance(facts, TimelineFacts) and facts.limits == TimelineLimits()
    assert (facts.run.id, facts.run.state) == (run_id, RunState.RUNNING)
    assert facts.tasks_total == data["tasks_total"] == 4
    # each task and item the api draws a row for, in the same order
    drawn = [(r["task_id"], r["name"]) for r in data["rows"] if r["kind"] in ("task", "item")]
    assert [(str(t.id), t.name) for t in facts.tasks] == drawn
    flaky = facts.tasks[0]
    assert [(a.attempt, a.outcome, a.worker) for a in flaky.attempts] == [
        (1, "failed", "w-1"),
        (2, "succeeded", "w-2"),
    ]
    assert flaky.attempts[0].error == ERROR  # whole, as stored: the api sends its first line
    assert flaky.attempts[0].started_at == attempt_rows(sql, ids["flaky"])[0][1]
    (rest,) = facts.rests
    assert (rest.map_id, rest.n, rest.counts) == (ids["process"], ITEMS - 20, {"READY": 5})
    running = facts.tasks[4]  # process[1], claimed and left running
    assert running.state == "RUNNING" and running.attempts[0].finished_at is None
    assert facts.now >= running.attempts[0].started_at  # the database's clock
    # the limits given bound the read, and what they leave out is counted
    assert [t.name for t in few.tasks] == ["flaky", "list"] and few.tasks_total == 4
    assert [a.attempt for a in few.tasks[0].attempts] == [2]
