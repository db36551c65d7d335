"""The dashboard's JSON endpoints, pages and request-forgery checks against the api's server.

The api is the api role served from this process (tests/api_here.py, through
tests/api_client.py's helpers; the api child itself is test_api.py's); states are
driven through the repository as in test_transitions.py; every request goes over a socket.
Proven here:

- ``GET /api/v1/overview``: runs and tasks by state (every state present), tasks finished per
  minute over the last hour (60 minutes), retry backlog, poison candidates (threshold), dead
  tasks by reason, outbox lag, live processes by host and role;
- ``GET /api/v1/runs/{id}/graph``: every task with its state and coordinates, an edge (with a
  path) for every dependency;
- ``GET /api/v1/task-runs/{id}``: attempts with worker, times, outcome, reason, error and
  traceback; the run input, upstream results, the result and the requeue audit;
- ``GET /api/v1/dead``: filters by reason, workflow and handler, keyset pages;
- ``POST /api/v1/dead/requeue``: a dry run counts and changes nothing; a real one requeues the
  matches with an audit row each carrying the reason; at most 1,000 per request (slow);
- ``GET /api/v1/runs?since=&until=`` bounds the creation time; ``GET /api/v1/processes``;
- CSRF: a cross-site ``Origin`` or ``Sec-Fetch-Site`` is a 403, a form body a 415, and nothing
  changes;
- the pages under ``/ui`` are HTML with the contract's selectors, the assets have the right
  content types and nothing points off-site, ``/`` redirects; the schedules page is open (its
  data needs the token) under the same Content-Security-Policy, and never renders its query;
- a sleeping timer's graph node and task detail carry its sleep and wake time;
- bad ids, filters, cursors and bodies are JSON 4xx, never a 500.
"""

from __future__ import annotations

import base64
import itertools
import os
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from tests.api_client import (
    UNKNOWN_ID,
    Api,
    Reply,
    StartApi,
    assert_json_error,
    serve_here,
)
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, chain, claim_task, diamond, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

BULK = "/api/v1/dead/requeue"
SLOW_RETRY = RetryPolicy(max_attempts=5, base_delay=600.0, max_delay=600.0, jitter=Jitter.NONE)
ONE_SHOT = RetryPolicy(max_attempts=1)
#: A dead task of each: (workflow, handler, reason it failed with, reason it is buried with).
DEAD_KINDS = {
    "a-perm": ("dash-a", "h.one", FailureReason.PERMANENT_ERROR, FailureReason.PERMANENT_ERROR),
    "b-unknown": ("dash-b", "h.two", FailureReason.UNKNOWN_HANDLER, FailureReason.UNKNOWN_HANDLER),
    "b-exhausted": (
        "dash-b",
        "h.one",
        FailureReason.HANDLER_ERROR,
        FailureReason.MAX_ATTEMPTS_EXCEEDED,
    ),
}
FORM_BODIES = [
    ("application/x-www-form-urlencoded", b"reason=x&dry_run=false"),
    (
        "multipart/form-data; boundary=xyz",
        b'--xyz\r\nContent-Disposition: form-data; name="reason"\r\n\r\nx\r\n--xyz--\r\n',
    ),
    ("text/plain", b'{"reason": "x"}'),
    ("Text/Plain; charset=utf-8", b'{"reason": "x"}'),
]
PAGES = {
    "/ui/": [
        "overview",
        "run-count-SUCCEEDED",
        "task-count-DEAD",
        "throughput-chart",
        "retry-backlog",
        "poison-candidates",
        "dead-by-reason",
        "outbox-lag",
        "processes-summary",
    ],
    "/ui/runs": ["runs-table", "apply-filters", "next-page", "prev-page"],
    f"/ui/runs/{UNKNOWN_ID}": [
        "run-state",
        "dag",
        "task-panel",
        "task-state",
        "error",
        "traceback",
        "task-input",
        "task-result",
        "cancel-run",
        "run-reason",
        "rerun-run",
    ],
    "/ui/schedules": [
        "schedules-table",
        "schedule-panel",
        "panel-state",
        "schedule-input",
        "schedule-history",
    ],
    "/ui/dead": ["apply-filters", "requeue-all", "dry-run-count", "confirm-requeue-all"],
    "/ui/processes": ["processes-table"],
    "/ui/flow": ["breakers-table", "pauses-table", "open-breaker-form", "pause-form"],
}
COMMON_TESTIDS = [
    "nav-overview",
    "nav-runs",
    "nav-schedules",
    "nav-dead",
    "nav-processes",
    "nav-flow",
    "token",
    "save-token",
    "flash",
]
ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
#: The only absolute URL allowed in a page or asset: the SVG namespace (not fetched).
OFF_SITE = re.compile(r"(?:https?:)?//(?!www\.w3\.org/2000/svg)[a-z0-9.-]+\.[a-z]{2,}", re.I)


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    """One api (with a token) for this module, on the session database, served from this
    process (the api child itself: test_api.py's module api)."""
    stack = Stack(tmp_path_factory.mktemp("dashboard-api"), database_url, broker_url)
    found, server = serve_here(stack)
    try:
        yield found
    finally:
        server.stop()
        stack.delete_queue()


def ok(reply: Reply) -> Any:
    assert reply.status == 200, (reply.status, reply.body[:500])
    assert reply.headers.get_content_type() == "application/json"
    return reply.json()


def fail_attempt(
    repo: Store,
    sql: Sql,
    task_id: uuid.UUID,
    reason: FailureReason,
    error: str,
    traceback: str | None = None,
    worker: str = "worker-1",
) -> None:
    claim = claim_task(repo, sql, task_id, worker)
    assert repo.finish(
        task_id,
        claim.fencing_token,
        TaskState.FAILED,
        reason=reason,
        error=error,
        traceback=traceback,
    )


def bury(repo: Store, sql: Sql, kind: str, n: int = 0) -> str:
    """A dead task of ``kind`` (see DEAD_KINDS), driven through the repository."""
    workflow, handler, reason, buried = DEAD_KINDS[kind]
    definition = WorkflowDef(workflow, (TaskDef("only", handler, retry=ONE_SHOT),))
    run_id = repo.trigger(definition, {"kind": kind, "n": n}).run_id
    task_id = task_ids(repo, run_id)["only"]
    fail_attempt(repo, sql, task_id, reason, f"{kind} failed", f"Traceback: {kind}")
    drain(repo)
    task = repo.get_task(task_id)
    assert (task.state, task.failure_reason) == (TaskState.DEAD, buried)
    return str(task_id)


def states(sql: Sql, ids: list[str]) -> dict[str, str]:
    found = sql.execute(
        "SELECT id::text, state FROM task_runs WHERE id = ANY(%s::uuid[])", (ids,)
    ).fetchall()
    return {r[0]: r[1] for r in found}


def audit_rows(sql: Sql) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT task_run_id::text, requested_by, reason, previous_reason, attempt"
        " FROM requeue_audit ORDER BY id"
    ).fetchall()


def walk_dead(api: Api, query: str, limit: int) -> list[str]:
    """Every dead task id of ``/api/v1/dead?{query}`` following ``next_cursor``; bounded."""
    found: list[str] = []
    cursor: str | None = None
    for _ in range(50):
        path = f"/api/v1/dead?limit={limit}" + (f"&{query}" if query else "")
        data = ok(api.get(path + (f"&cursor={cursor}" if cursor else "")))
        assert set(data) == {"tasks", "next_cursor"}
        found += [t["id"] for t in data["tasks"]]
        cursor = data["next_cursor"]
        if cursor is None:
            return found
        assert len(data["tasks"]) == limit
    raise AssertionError("pagination did not end")


# ------------------------------------------------------------------ overview


def test_overview_of_an_empty_system_has_every_state_at_zero(
    api: Api, clean_database_url: str
) -> None:
    data = ok(api.get("/api/v1/overview"))
    assert data["runs"] == dict.fromkeys(RunState, 0)
    assert data["tasks"] == dict.fromkeys(TaskState, 0)
    minutes = data["finished_per_minute"]
    assert len(minutes) == 60
    stamps = [datetime.fromisoformat(m["minute"]) for m in minutes]
    assert all(b - a == timedelta(minutes=1) for a, b in itertools.pairwise(stamps))
    assert all((m["succeeded"], m["dead"], m["cancelled"]) == (0, 0, 0) for m in minutes)
    assert data["retry_backlog"] == {"n": 0, "next_at": None, "latest_at": None}
    assert data["poison_candidates"] == []
    assert data["dead_by_reason"] == {}
    assert data["outbox"] == {"pending": 0, "oldest_s": 0.0}
    assert data["poison_threshold"] == 3


def test_overview_counts_what_the_system_holds(api: Api, repo: Store, sql: Sql) -> None:
    # one run that succeeds, one whose task waits to retry, one dead task, one untouched diamond
    done = repo.trigger(chain("dash-done", length=1)).run_id
    claim = claim_task(repo, sql, task_ids(repo, done)["t0"])
    assert repo.finish(claim.task_run_id, claim.fencing_token, TaskState.SUCCEEDED, result=1)
    retrying = repo.trigger(
        WorkflowDef("dash-retry", (TaskDef("only", "h.flaky", retry=SLOW_RETRY),))
    ).run_id
    flaky = task_ids(repo, retrying)["only"]
    fail_attempt(repo, sql, flaky, FailureReason.HANDLER_ERROR, "flaky")
    bury(repo, sql, "a-perm")
    drain(repo)
    waiting = repo.trigger(diamond("dash-diamond")).run_id  # a READY with an unpublished row
    sql.execute(
        "UPDATE outbox SET published_at = now() WHERE task_run_id <> %s",
        (task_ids(repo, waiting)["a"],),
    )
    repo.register_process(uuid.uuid4(), "host-a", 101, "worker")
    repo.register_process(uuid.uuid4(), "host-a", 102, "worker")
    repo.register_process(uuid.uuid4(), "host-b", 201, "scheduler")
    silent = uuid.uuid4()
    repo.register_process(silent, "host-c", 301, "worker")
    sql.execute(
        "UPDATE processes SET last_seen_at = now() - interval '1 hour' WHERE id = %s", (silent,)
    )

    data = ok(api.get("/api/v1/overview"))
    assert data["runs"] == {
        **dict.fromkeys(RunState, 0),
        "SUCCEEDED": 1,
        "RUNNING": 1,
        "FAILED": 1,
        "PENDING": 1,
    }
    assert data["tasks"] == {
        **dict.fromkeys(TaskState, 0),
        "SUCCEEDED": 1,
        "RETRYING": 1,
        "DEAD": 1,
        "READY": 1,
        "PENDING": 3,
    }
    finished = data["finished_per_minute"]
    assert sum(m["succeeded"] for m in finished) == 1
    assert sum(m["dead"] for m in finished) == 1
    assert finished[-1]["succeeded"] + finished[-2]["succeeded"] == 1  # within the last minutes
    backlog = data["retry_backlog"]
    assert backlog["n"] == 1 and backlog["next_at"] is not None
    assert data["poison_candidates"] == []  # 1 attempt < the default threshold of 3
    assert data["dead_by_reason"] == {"permanent_error": 1}
    assert data["outbox"]["pending"] == 1 and data["outbox"]["oldest_s"] >= 0
    live = [p for p in data["processes"] if p["role"] != "api"]  # the api registers itself
    assert live == [
        {"host": "host-a", "role": "worker", "n": 2},
        {"host": "host-b", "role": "scheduler", "n": 1},
    ]

    poison = ok(api.get("/api/v1/overview?poison_threshold=1"))
    assert poison["poison_threshold"] == 1
    (candidate,) = poison["poison_candidates"]
    assert (candidate["id"], candidate["workflow"], candidate["attempt"], candidate["state"]) == (
        str(flaky),
        "dash-retry",
        1,
        "RETRYING",
    )


# ------------------------------------------------------------------ the run graph


def test_graph_has_every_task_with_state_and_coordinates_and_every_edge(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(diamond("dash-graph"), {"order": 1}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED, result={"a": 1})
    drain(repo)

    data = ok(api.get(f"/api/v1/runs/{run_id}/graph"))
    assert data["run"]["id"] == str(run_id) and data["run"]["state"] == "RUNNING"
    assert "tasks" not in data["run"]
    nodes = {n["name"]: n for n in data["nodes"]}
    assert {name: n["state"] for name, n in nodes.items()} == {
        "a": "SUCCEEDED",
        "b": "READY",
        "c": "READY",
        "d": "PENDING",
    }
    for name, node in nodes.items():
        assert node["task_id"] == str(ids[name])
        assert node["handler"] == "tests.noop" and node["label"] == name
        for key in ("x", "y", "width", "height"):
            assert isinstance(node[key], int | float) and node[key] >= 0
        assert node["x"] + node["width"] <= data["width"]
        assert node["y"] + node["height"] <= data["height"]
    assert nodes["a"]["y"] < nodes["b"]["y"] == nodes["c"]["y"] < nodes["d"]["y"]
    edges = {(e["from"], e["to"]): e for e in data["edges"]}
    assert set(edges) == {("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")}
    for (source, target), edge in edges.items():
        assert len(edge["points"]) >= 2
        assert edge["path"].startswith(f"M{edge['points'][0][0]},{edge['points'][0][1]}")
        assert edge["points"][0][1] == nodes[source]["y"] + nodes[source]["height"]
        assert edge["points"][-1][1] == nodes[target]["y"]
    # the states move, the layout stays
    claim = claim_task(repo, sql, ids["b"])
    again = ok(api.get(f"/api/v1/runs/{run_id}/graph"))
    assert {n["name"]: n["state"] for n in again["nodes"]}["b"] == "RUNNING"
    assert [(n["x"], n["y"]) for n in again["nodes"]] == [(n["x"], n["y"]) for n in data["nodes"]]


# ------------------------------------------------------------------ task detail


def test_task_detail_has_attempts_with_error_and_traceback_input_and_result(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(chain("dash-chain", length=2, retry=FAST_RETRY), {"order": 7}).run_id
    ids = task_ids(repo, run_id)
    trace = 'Traceback (most recent call last):\n  File "h.py", line 3\nValueError: boom <1>'
    fail_attempt(repo, sql, ids["t0"], FailureReason.HANDLER_ERROR, "boom <1>", trace, "w-1")
    drain(repo)  # RETRYING, then READY again (no delay)
    claim = claim_task(repo, sql, ids["t0"], "w-2")
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED, result={"ok": True})
    drain(repo)

    data = ok(api.get(f"/api/v1/task-runs/{ids['t0']}"))
    assert set(data) == {
        "task",
        "workflow",
        "run_state",
        "input",
        "upstream",
        "result",
        "attempts",
        "audit",
    }
    assert (data["task"]["id"], data["task"]["state"], data["task"]["attempt"]) == (
        str(ids["t0"]),
        "SUCCEEDED",
        2,
    )
    assert (data["workflow"], data["run_state"]) == ("dash-chain", "RUNNING")
    assert data["input"] == {"order": 7} and data["upstream"] == {}
    assert data["result"] == {"ok": True} and data["audit"] == []
    first, second = data["attempts"]
    assert (first["attempt"], first["worker"], first["outcome"], first["failure_reason"]) == (
        1,
        "w-1",
        "failed",
        "handler_error",
    )
    assert (first["error"], first["traceback"]) == ("boom <1>", trace)
    assert first["started_at"] and first["finished_at"] and first["duration_s"] is not None
    assert (second["attempt"], second["worker"], second["outcome"]) == (2, "w-2", "succeeded")
    assert second["error"] is None and second["traceback"] is None

    downstream = ok(api.get(f"/api/v1/task-runs/{ids['t1']}"))
    assert downstream["upstream"] == {"t0": {"ok": True}}
    assert downstream["task"]["depends_on"] == ["t0"]
    assert downstream["attempts"] == [] and downstream["result"] is None


# ------------------------------------------------------------------ dead tasks


def test_dead_tasks_filter_by_reason_workflow_and_handler_and_page(
    api: Api, repo: Store, sql: Sql
) -> None:
    buried = [
        bury(repo, sql, kind, n)
        for n, kind in enumerate(["a-perm", "b-unknown", "a-perm", "b-exhausted", "a-perm"])
    ]
    newest_first = list(reversed(buried))
    perm = [buried[0], buried[2], buried[4]]

    everything = ok(api.get("/api/v1/dead"))
    assert [t["id"] for t in everything["tasks"]] == newest_first
    assert everything["next_cursor"] is None
    first = everything["tasks"][0]
    assert (first["workflow"], first["handler"], first["state"], first["failure_reason"]) == (
        "dash-a",
        "h.one",
        "DEAD",
        "permanent_error",
    )
    assert first["last_error"] == "a-perm failed"

    def ids(query: str) -> list[str]:
        return [t["id"] for t in ok(api.get(f"/api/v1/dead?{query}"))["tasks"]]

    assert ids("reason=permanent_error") == [i for i in newest_first if i in perm]
    assert ids("reason=PERMANENT_ERROR") == ids("reason=permanent_error")
    assert ids("reason=unknown_handler") == [buried[1]]
    assert ids("reason=max_attempts_exceeded") == [buried[3]]
    assert ids("reason=crash_loop") == []
    assert ids("workflow=dash-b") == [buried[3], buried[1]]
    assert ids("handler=h.one") == [i for i in newest_first if i != buried[1]]
    assert ids("workflow=dash-b&handler=h.one") == [buried[3]]
    assert ids("workflow=dash-a&reason=unknown_handler") == []
    assert ids("workflow=nope") == []

    assert walk_dead(api, "", 2) == newest_first  # each exactly once, newest first
    assert walk_dead(api, "handler=h.one", 1) == [i for i in newest_first if i != buried[1]]


def test_a_bulk_dry_run_changes_nothing_and_a_real_one_requeues_with_audit_rows(
    api: Api, repo: Store, sql: Sql
) -> None:
    perm = [bury(repo, sql, "a-perm", n) for n in range(3)]
    other = [bury(repo, sql, "b-unknown"), bury(repo, sql, "b-exhausted")]
    body = {"reason": "bug 42 fixed", "reason_filter": "permanent_error", "workflow": "dash-a"}

    dry = ok(api.post(BULK, {**body, "dry_run": True}))
    assert dry == {
        "dry_run": True,
        "matched": 3,
        "requeued": 0,
        "skipped": 0,
        "limit": 1000,
        "more": False,
        "requeued_ids": [],
    }
    assert set(states(sql, perm + other).values()) == {"DEAD"}
    assert audit_rows(sql) == []

    done = ok(api.post(BULK, {**body, "dry_run": False, "requested_by": "alice"}))
    assert (done["dry_run"], done["matched"], done["requeued"], done["skipped"]) == (False, 3, 3, 0)
    assert sorted(done["requeued_ids"]) == sorted(perm)
    assert states(sql, perm) == dict.fromkeys(perm, "PENDING")
    assert states(sql, other) == dict.fromkeys(other, "DEAD")
    assert sorted(audit_rows(sql)) == sorted(
        (tid, "alice", "bug 42 fixed", "permanent_error", 1) for tid in perm
    )
    assert ok(api.post(BULK, body))["matched"] == 0  # nothing left to match

    # no filter at all: every dead task; the requester defaults to the dashboard
    everything = ok(api.post(BULK, {"reason": "all of them", "dry_run": False}))
    assert (everything["matched"], everything["requeued"]) == (2, 2)
    assert {r[1:3] for r in audit_rows(sql)[3:]} == {("dashboard", "all of them")}
    assert ok(api.get("/api/v1/dead"))["tasks"] == []


def test_a_single_requeue_is_audited_with_its_reason_and_shown_in_the_task_detail(
    api: Api, repo: Store, sql: Sql
) -> None:
    dead = bury(repo, sql, "a-perm")
    reply = api.post(
        f"/api/v1/task-runs/{dead}/requeue",
        {"reason": "retry after fix", "requested_by": "dashboard"},
    )
    assert ok(reply)["state"] == "PENDING"
    (entry,) = ok(api.get(f"/api/v1/task-runs/{dead}"))["audit"]
    assert {k: entry[k] for k in ("requested_by", "reason", "previous_reason", "attempt")} == {
        "requested_by": "dashboard",
        "reason": "retry after fix",
        "previous_reason": "permanent_error",
        "attempt": 1,
    }
    assert entry["requested_at"]


@pytest.mark.slow
def test_a_bulk_requeue_takes_at_most_1000_tasks_per_request(api: Api, sql: Sql) -> None:
    total = 1005
    sql.execute(
        "INSERT INTO workflow_definitions (name, digest, definition) VALUES ('bulk', 'd', '{}')"
    )
    sql.execute(
        "WITH runs AS ("
        "  INSERT INTO workflow_runs (id, workflow, workflow_digest, state, input, fail_fast,"
        "                             finished_at)"
        "  SELECT gen_random_uuid(), 'bulk', 'd', 'FAILED', '{}', true, now()"
        "    FROM generate_series(1, %s) RETURNING id)"
        " INSERT INTO task_runs (id, run_id, name, handler, state, pending_deps, attempt,"
        "                        max_attempts, base_delay_s, max_delay_s, jitter, failure_reason,"
        "                        finished_at)"
        " SELECT gen_random_uuid(), id, 'only', 'h.bulk', 'DEAD', 0, 1, 1, 0, 0, 'none',"
        "        'permanent_error', now() FROM runs",
        (total,),
    )
    body = {"reason": "mass fix", "handler": "h.bulk"}
    dry = ok(api.post(BULK, {**body, "dry_run": True}))
    assert (dry["matched"], dry["requeued"], dry["limit"], dry["more"]) == (total, 0, 1000, True)
    first = ok(api.request("POST", BULK, body, timeout=120))
    assert (first["matched"], first["requeued"], first["more"]) == (total, 1000, True)
    assert len(set(first["requeued_ids"])) == 1000
    second = ok(api.post(BULK, body))
    assert (second["matched"], second["requeued"], second["more"]) == (5, 5, False)
    row = sql.execute("SELECT count(*), count(DISTINCT task_run_id) FROM requeue_audit").fetchone()
    assert row == (total, total)


# ------------------------------------------------------------------ runs by time, processes


def test_runs_can_be_bounded_by_creation_time(api: Api, repo: Store, sql: Sql) -> None:
    base = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    created = {}
    for hours in range(5):
        run_id = str(repo.trigger(chain("dash-time", length=1), {"h": hours}).run_id)
        sql.execute(
            "UPDATE workflow_runs SET created_at = %s WHERE id = %s",
            (base + timedelta(hours=hours), run_id),
        )
        created[hours] = run_id

    def ids(query: str) -> list[str]:
        return [r["id"] for r in ok(api.get(f"/api/v1/runs?{query}"))["runs"]]

    def iso(hours: float) -> str:
        return quote((base + timedelta(hours=hours)).isoformat())

    assert ids(f"since={iso(1)}&until={iso(3)}") == [created[2], created[1]]  # [since, until)
    assert ids(f"since={iso(3)}") == [created[4], created[3]]
    assert ids(f"until={iso(1)}") == [created[0]]
    assert ids("since=2024-05-01T13:00:00Z&until=2024-05-01T14:00:00Z") == [created[1]]
    assert ids("since=2024-05-01T13:00:00&until=2024-05-01T14:00:00") == [created[1]]  # UTC
    assert ids(f"since={quote('2024-05-01T15:00:00+02:00')}") == ids(f"since={iso(1)}")
    assert ids(f"since={iso(5)}") == []
    page = ok(api.get(f"/api/v1/runs?since={iso(1)}&limit=2"))
    assert [r["id"] for r in page["runs"]] == [created[4], created[3]]
    rest = ids(f"since={iso(1)}&limit=2&cursor={page['next_cursor']}")
    assert rest == [created[2], created[1]]
    assert ids(f"since={iso(1)}&until={iso(4)}&state=pending&workflow=dash-time") == [
        created[3],
        created[2],
        created[1],
    ]


def test_processes_lists_every_registered_process(
    api_here: StartApi, repo: Store, sql: Sql
) -> None:
    """On an api started after the tables were emptied (served from this process, so its own
    registration is there at once: the module's api re-registers only every 5 s)."""
    api = api_here()
    worker, stale = uuid.uuid4(), uuid.uuid4()
    repo.register_process(worker, "host-a", 4242, "worker")
    repo.register_process(stale, "host-b", 4343, "publisher")
    sql.execute(
        "UPDATE processes SET last_seen_at = now() - interval '2 minutes' WHERE id = %s", (stale,)
    )
    found = {p["pid"]: p for p in ok(api.get("/api/v1/processes"))["processes"]}
    assert found[4242]["host"] == "host-a" and found[4242]["role"] == "worker"
    assert found[4242]["live"] is True and found[4242]["id"] == str(worker)
    assert found[4343]["live"] is False and found[4343]["silent_s"] >= 119
    for process in found.values():
        assert {
            "id",
            "host",
            "pid",
            "role",
            "started_at",
            "last_seen_at",
            "silent_s",
            "live",
        } <= process.keys()
    assert found[os.getpid()]["role"] == "api"  # the api registers itself


# ------------------------------------------------------------------ request forgery


def test_cross_site_mutations_are_refused_and_change_nothing(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(diamond("dash-csrf")).run_id
    dead = bury(repo, sql, "a-perm")
    cancel = f"/api/v1/runs/{run_id}/cancel"
    attempts = [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://127.0.0.1:{api.port + 1}"},
        {"Origin": f"http://localhost:{api.port}"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site", "Origin": f"http://127.0.0.1:{api.port}"},
    ]
    for headers in attempts:
        assert "refused" in assert_json_error(api.post(cancel, headers=headers), 403)
        assert_json_error(
            api.post(f"/api/v1/task-runs/{dead}/requeue", {"reason": "x"}, headers=headers), 403
        )
        assert_json_error(api.post(BULK, {"reason": "x"}, headers=headers), 403)
        assert_json_error(
            api.post("/api/v1/runs", {"workflow": "api-record"}, headers=headers), 403
        )
    run = repo.get_run(run_id)
    assert run.state is RunState.PENDING and not run.cancel_requested
    assert states(sql, [dead]) == {dead: "DEAD"} and audit_rows(sql) == []
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (2,)

    # the api's own origin, and a browser's same-origin fetch, pass
    same = {"Origin": f"http://127.0.0.1:{api.port}", "Sec-Fetch-Site": "same-origin"}
    assert ok(api.post(cancel, headers=same))["cancel_requested"] is True


@pytest.mark.parametrize(("content_type", "body"), FORM_BODIES)
def test_a_form_encoded_body_with_a_valid_token_is_refused_with_415(
    api: Api, repo: Store, sql: Sql, content_type: str, body: bytes
) -> None:
    dead = bury(repo, sql, "a-perm")
    run_id = repo.trigger(diamond("dash-form")).run_id
    headers = {"Content-Type": content_type}
    for path in (
        BULK,
        f"/api/v1/task-runs/{dead}/requeue",
        f"/api/v1/runs/{run_id}/cancel",
        "/api/v1/runs",
    ):
        assert_json_error(api.post(path, body, headers=headers), 415)
    assert states(sql, [dead]) == {dead: "DEAD"} and audit_rows(sql) == []
    assert not repo.get_run(run_id).cancel_requested
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (2,)


def test_the_new_mutations_need_the_bearer_token(api: Api, repo: Store, sql: Sql) -> None:
    dead = bury(repo, sql, "a-perm")
    assert_json_error(api.post(BULK, {"reason": "x"}, auth=False), 401)
    assert_json_error(api.post(BULK, {"reason": "x"}, headers={"Authorization": "Bearer no"}), 403)
    assert states(sql, [dead]) == {dead: "DEAD"} and audit_rows(sql) == []


# ------------------------------------------------------------------ pages and assets


def test_the_pages_are_html_with_the_contracts_selectors(api: Api, clean_database_url: str) -> None:
    for path, testids in PAGES.items():
        reply = api.get(path)
        assert reply.status == 200, (path, reply.status, reply.body[:300])
        assert reply.headers.get_content_type() == "text/html", path
        assert reply.headers.get_content_charset() == "utf-8"
        assert "script-src 'self'" in reply.headers["Content-Security-Policy"]
        assert reply.headers["X-Content-Type-Options"] == "nosniff"
        page = reply.body.decode()
        assert page.startswith("<!doctype html>")
        for testid in COMMON_TESTIDS + testids:
            assert f'data-testid="{testid}"' in page, (path, testid)
        assert not OFF_SITE.search(page), (path, OFF_SITE.search(page))
    runs = api.get("/ui/runs").body.decode()
    for name in ("state", "workflow", "since", "until"):
        assert f'name="{name}"' in runs
    assert all(f'<option value="{s}">' in runs for s in RunState)
    assert '<option value="SCHEDULED">' in runs  # delayed runs (issue 18)
    dead = api.get("/ui/dead").body.decode()
    assert all(f'<option value="{r}">' in dead for r in FailureReason)
    assert 'name="requeue-reason"' in dead
    assert api.get("/ui").body == api.get("/ui/").body


def test_the_assets_are_served_with_their_content_types_and_nothing_off_site(
    api: Api, clean_database_url: str
) -> None:
    wanted: set[str] = set()
    for path in PAGES:
        wanted |= set(re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', api.get(path).body.decode()))
    assert {"/ui/static/app.js", "/ui/static/style.css", "/ui/static/favicon.svg"} <= wanted
    seen: set[str] = set()
    while wanted - seen:
        path = sorted(wanted - seen)[0]
        seen.add(path)
        reply = api.get(path)
        assert reply.status == 200, (path, reply.status)
        suffix = path[path.rindex(".") :]
        assert reply.headers.get_content_type() == ASSET_TYPES[suffix], path
        text = reply.body.decode()
        assert not OFF_SITE.search(text), (path, OFF_SITE.search(text))
        if suffix == ".js":  # module imports are fetched too
            wanted |= {f"/ui/static/{m}" for m in re.findall(r'from "\./([\w.-]+)"', text)}
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path
        etag = reply.headers["ETag"]
        again = api.request("GET", path, auth=False, headers={"If-None-Match": etag})
        assert again.status == 304, path
    assert "/ui/static/schedules.js" in seen
    assert len(seen) >= 9  # app, 6 page scripts, style, icon


#: The pages' Content-Security-Policy, as it was before the schedules page: a new page must
#: not need a looser one (no inline script or style, nothing from another origin).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def test_the_schedules_page_is_open_its_data_needs_the_token_and_the_csp_is_unchanged(
    api: Api, clean_database_url: str
) -> None:
    for path in PAGES:
        assert api.get(path).headers["Content-Security-Policy"] == CSP, path
    page = api.request("GET", "/ui/schedules", auth=False)
    assert page.status == 200 and page.headers["Content-Security-Policy"] == CSP
    text = page.body.decode()
    # nothing the policy would block: every script is a file of this origin, no handler
    # attribute, no inline style
    assert re.findall(r"<script\b[^>]*>", text) == [
        '<script type="module" src="/ui/static/schedules.js">'
    ]
    assert not re.search(r"\son[a-z]+=|\sstyle=|<style", text, re.I)
    assert 'data-testid="nav-schedules" href="/ui/schedules" aria-current="page"' in text
    # the page is a fixed shell: a query string (the panel's ?schedule=) is never rendered
    probe = quote('<b data-testid="injected">x</b>')
    assert api.request("GET", f"/ui/schedules?schedule={probe}", auth=False).body == page.body
    # what it shows, and what it does, needs the token
    assert_json_error(api.request("GET", "/api/v1/schedules", auth=False), 401)
    wrong = {"Authorization": "Bearer wrong"}
    assert "invalid token" in assert_json_error(
        api.request("GET", "/api/v1/schedules", auth=False, headers=wrong), 403
    )
    for action in ("pause", "resume", "trigger"):
        assert_json_error(api.post(f"/api/v1/schedules/x%2F0/{action}", auth=False), 401)
        refused = api.post(
            f"/api/v1/schedules/x%2F0/{action}", headers={"Origin": "http://evil.example"}
        )
        assert "refused" in assert_json_error(refused, 403)


def test_the_graph_shows_when_a_sleeping_timer_wakes(api: Api, repo: Store) -> None:
    flow = WorkflowDef(
        "dash-timer",
        (TaskDef("nap", sleep=3600.0), TaskDef("after", "tests.noop", depends_on=("nap",))),
    )
    run_id = repo.trigger(flow).run_id
    ids = task_ids(repo, run_id)
    drain(repo)  # the timer falls asleep
    nap = repo.get_task(ids["nap"])
    assert nap.state is TaskState.RUNNING and nap.wake_at is not None

    nodes = {n["name"]: n for n in ok(api.get(f"/api/v1/runs/{run_id}/graph"))["nodes"]}
    assert nodes["nap"]["sleep_s"] == 3600.0
    assert datetime.fromisoformat(nodes["nap"]["wake_at"]) == nap.wake_at
    assert (nodes["after"]["sleep_s"], nodes["after"]["wake_at"]) == (None, None)
    task = ok(api.get(f"/api/v1/task-runs/{ids['nap']}"))["task"]
    assert datetime.fromisoformat(task["wake_at"]) == nap.wake_at and task["sleep_s"] == 3600.0


def test_root_redirects_to_the_overview(api: Api) -> None:
    reply = api.get("/")
    assert reply.status in (301, 302, 303, 307, 308)
    assert reply.headers["Location"].endswith("/ui/")


# ------------------------------------------------------------------ bad requests


REQUEUE_UNKNOWN = f"/api/v1/task-runs/{UNKNOWN_ID}/requeue"
OUT_OF_RANGE = f"0001-01-01T00:00:00+14:00|{UNKNOWN_ID}"


def _cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _bad(name: str, method: str, path: str, body: Any = None, status: int = 400) -> Any:
    return pytest.param(method, path, body, status, id=name)


BAD_REQUESTS = [
    _bad("graph-id-malformed", "GET", "/api/v1/runs/not-a-uuid/graph"),
    _bad("graph-id-unknown", "GET", f"/api/v1/runs/{UNKNOWN_ID}/graph", status=404),
    _bad("task-id-malformed", "GET", "/api/v1/task-runs/12"),
    _bad("task-id-unknown", "GET", f"/api/v1/task-runs/{UNKNOWN_ID}", status=404),
    _bad("page-run-id-malformed", "GET", "/ui/runs/not-a-uuid"),
    _bad("asset-unknown", "GET", "/ui/static/nope.js", status=404),
    _bad("asset-traversal", "GET", "/ui/static/..%2fpages.py", status=404),
    _bad("asset-not-served-suffix", "GET", "/ui/static/../templates/layout.html", status=404),
    _bad("ui-unknown", "GET", "/ui/nope", status=404),
    _bad("ui-schedules-subpath", "GET", "/ui/schedules/ui-pair/0", status=404),
    _bad("post-ui-schedules", "POST", "/ui/schedules", {"x": 1}, status=405),
    _bad("dead-reason-unknown", "GET", "/api/v1/dead?reason=sleepy"),
    _bad("dead-reason-empty", "GET", "/api/v1/dead?reason="),
    _bad("dead-cursor-garbage", "GET", "/api/v1/dead?cursor=abc"),
    _bad("dead-cursor-naive", "GET", "/api/v1/dead?cursor=MjAyNC0wMS0wMVQwMDowMDowMHx4"),
    _bad("dead-limit-zero", "GET", "/api/v1/dead?limit=0"),
    _bad("dead-limit-huge", "GET", "/api/v1/dead?limit=100000"),
    _bad("dead-workflow-nul", "GET", "/api/v1/dead?workflow=a%00b"),
    _bad("dead-handler-too-long", "GET", "/api/v1/dead?handler=" + "h" * 600),
    _bad("runs-since-garbage", "GET", "/api/v1/runs?since=yesterday"),
    _bad("runs-until-bad-month", "GET", "/api/v1/runs?until=2024-13-01T00:00:00Z"),
    _bad("runs-since-empty", "GET", "/api/v1/runs?since="),
    _bad("runs-workflow-nul", "GET", "/api/v1/runs?workflow=%00"),
    _bad("overview-threshold-zero", "GET", "/api/v1/overview?poison_threshold=0"),
    _bad("overview-threshold-text", "GET", "/api/v1/overview?poison_threshold=many"),
    _bad("bulk-no-body", "POST", BULK, b""),
    _bad("bulk-not-an-object", "POST", BULK, ["reason"]),
    _bad("bulk-no-reason", "POST", BULK, {"dry_run": True}),
    _bad("bulk-blank-reason", "POST", BULK, {"reason": "   "}),
    _bad("bulk-reason-not-text", "POST", BULK, {"reason": 5}),
    _bad("bulk-reason-nul", "POST", BULK, {"reason": "a\u0000b"}),
    _bad("bulk-unknown-field", "POST", BULK, {"reason": "x", "everything": True}),
    _bad("bulk-dry-run-not-bool", "POST", BULK, {"reason": "x", "dry_run": "yes"}),
    _bad("bulk-reason-filter-unknown", "POST", BULK, {"reason": "x", "reason_filter": "bad"}),
    _bad("bulk-workflow-not-text", "POST", BULK, {"reason": "x", "workflow": 3}),
    _bad("bulk-handler-nul", "POST", BULK, {"reason": "x", "handler": "a\u0000"}),
    _bad("bulk-requester-empty", "POST", BULK, {"reason": "x", "requested_by": ""}),
    _bad("bulk-malformed-json", "POST", BULK, b"{"),
    _bad("bulk-reason-lone-surrogate", "POST", BULK, b'{"reason": "\\ud800"}'),
    _bad("bulk-workflow-lone-surrogate", "POST", BULK, b'{"reason": "x", "workflow": "\\udfff"}'),
    _bad("requeue-reason-lone-surrogate", "POST", REQUEUE_UNKNOWN, b'{"reason": "\\ud800"}'),
    _bad(
        "runs-since-before-year-1-in-utc", "GET", "/api/v1/runs?since=0001-01-01T00:00:00%2B14:00"
    ),
    _bad(
        "runs-until-after-year-9999-in-utc", "GET", "/api/v1/runs?until=9999-12-31T23:00:00-14:00"
    ),
    _bad("runs-cursor-out-of-range", "GET", f"/api/v1/runs?cursor={_cursor(OUT_OF_RANGE)}"),
    _bad("dead-cursor-out-of-range", "GET", f"/api/v1/dead?cursor={_cursor(OUT_OF_RANGE)}"),
    _bad("get-bulk", "GET", BULK, status=405),
    _bad("post-overview", "POST", "/api/v1/overview", {"x": 1}, status=405),
    _bad("post-graph", "POST", f"/api/v1/runs/{UNKNOWN_ID}/graph", {"x": 1}, status=405),
    _bad("post-processes", "POST", "/api/v1/processes", {"x": 1}, status=405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD_REQUESTS)
def test_a_bad_id_filter_cursor_or_body_is_a_json_4xx(
    api: Api, repo: Store, sql: Sql, method: str, path: str, body: Any, status: int
) -> None:
    dead = bury(repo, sql, "a-perm")
    assert_json_error(api.request(method, path, body), status)
    assert states(sql, [dead]) == {dead: "DEAD"} and audit_rows(sql) == []
