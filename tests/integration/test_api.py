"""The HTTP api (SPEC 5, 5.1) against the real api child (`flowforge role api`, `flowforge up`).

Every request goes over a socket with ``http.client``: to a real api child, or, for a test that
needs an api of its own config, to the api role served from this process (``api_here``,
tests/api_here.py). Proven here:

- ``POST /api/v1/runs`` creates (201, Location), replays an ``Idempotency-Key`` (200, same run)
  and refuses the key with another body (409); mutations need the bearer token (401 without,
  403 when wrong, 403 when the api has none configured);
- bad input of every kind is a 4xx with a JSON ``{"error": ...}`` body — never a 500, never a
  traceback — including 404, 405 and 413 (1 MiB by default, ``api.max_body_bytes`` otherwise);
- ``GET /api/v1/runs/{id}`` is ``flowforge status --json``; listing filters and pages every run
  exactly once; cancel, dead listing and an audited, refused-when-repeated requeue;
- ``/health/live``; ``/health/ready`` names the role that is missing;
- ``/metrics`` parses as Prometheus text and moves as tasks run under ``flowforge up``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowforge.domain.states import TaskState
from tests import cli_runner
from tests.api_client import (
    ANY_4XX,
    BOOT_TIMEOUT_S,
    MIB,
    RUN_TIMEOUT_S,
    TOKEN,
    TOKEN_ENV,
    UNKNOWN_ID,
    UP_STOP_TIMEOUT_S,
    Api,
    Reply,
    StartApi,
    api_settings,
    assert_json_error,
    count_runs,
    make_dead,
    module_api,
    start_api,
    wait_until_serving,
)
from tests.e2e import REPO, Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    """One api child (token set, default body limit) for the tests of this module that need
    no particular config. Tests that care about the data also take ``clean_database_url``."""
    with module_api(tmp_path_factory.mktemp("api"), database_url, broker_url) as found:
        yield found


# ------------------------------------------------------------------ creating runs


def test_create_returns_201_with_the_run_and_its_location(
    api: Api, clean_database_url: str
) -> None:
    reply = api.post("/api/v1/runs", {"workflow": "api-other", "input": {"n": 1}})
    assert reply.status == 201, reply.body
    assert reply.headers.get_content_type() == "application/json"
    run = reply.json()
    assert {"id", "workflow", "state", "tasks"} <= run.keys()
    assert (run["workflow"], run["state"], run["input"]) == ("api-other", "PENDING", {"n": 1})
    assert [t["name"] for t in run["tasks"]] == ["first", "second"]
    for task in run["tasks"]:
        assert {"id", "name", "state", "attempt", "failure_reason"} <= task.keys()
        uuid.UUID(task["id"])
    assert reply.headers["Location"] == f"/api/v1/runs/{run['id']}"
    again = api.get(reply.headers["Location"])
    assert again.status == 200 and again.json()["id"] == run["id"]
    # "input" may be left out: an empty object
    bare = api.post("/api/v1/runs", {"workflow": "api-record"})
    assert bare.status == 201, bare.body
    assert bare.json()["input"] == {}


def test_a_replayed_idempotency_key_returns_the_same_run_and_another_body_conflicts(
    api: Api, sql: Sql
) -> None:
    body = {"workflow": "api-record", "input": {"order": 7}}
    key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
    first = api.post("/api/v1/runs", body, headers=key)
    assert first.status == 201, first.body
    replay = api.post("/api/v1/runs", body, headers=key)
    assert replay.status == 200, replay.body
    assert replay.json()["id"] == first.json()["id"]
    assert replay.headers["Location"] == first.headers["Location"]
    other_input = api.post(
        "/api/v1/runs", {"workflow": "api-record", "input": {"order": 8}}, headers=key
    )
    assert "different" in assert_json_error(other_input, 409)
    other_workflow = api.post(
        "/api/v1/runs", {"workflow": "api-other", "input": {"order": 7}}, headers=key
    )
    assert_json_error(other_workflow, 409)
    assert count_runs(sql) == 1
    without_key = api.post("/api/v1/runs", body)
    assert without_key.status == 201 and without_key.json()["id"] != first.json()["id"]


def test_mutations_need_the_bearer_token(api: Api, sql: Sql) -> None:
    body = {"workflow": "api-record", "input": {}}
    missing = api.post("/api/v1/runs", body, auth=False)
    assert_json_error(missing, 401)
    assert "bearer" in missing.headers.get("WWW-Authenticate", "").lower()
    for header in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer    ", TOKEN):
        assert_json_error(api.post("/api/v1/runs", body, headers={"Authorization": header}), 401)
    for wrong in ("wrong", TOKEN + "x", TOKEN[:-1], TOKEN.upper()):
        reply = api.post("/api/v1/runs", body, headers={"Authorization": f"Bearer {wrong}"})
        assert_json_error(reply, 403)
    for path in (
        f"/api/v1/runs/{UNKNOWN_ID}/cancel",
        f"/api/v1/task-runs/{UNKNOWN_ID}/requeue",
    ):
        assert_json_error(api.post(path, auth=False), 401)
        assert_json_error(api.post(path, headers={"Authorization": "Bearer wrong"}), 403)
    assert count_runs(sql) == 0
    # reads with the token (tests/integration/test_api_hardening.py: without it)
    for path in ("/api/v1/runs", "/api/v1/dead", "/health/live", "/metrics"):
        assert api.get(path).status == 200, path
    assert api.post("/api/v1/runs", body).status == 201
    assert count_runs(sql) == 1


def test_without_a_configured_token_every_mutation_is_refused(api_here: StartApi, sql: Sql) -> None:
    api = api_here(token=None)
    body = {"workflow": "api-record", "input": {}}
    for token in ("anything", TOKEN, ""):
        reply = api.post("/api/v1/runs", body, headers={"Authorization": f"Bearer {token}"})
        assert_json_error(reply, 403 if token else 401)
    assert_json_error(api.post("/api/v1/runs", body), (401, 403))
    assert_json_error(
        api.post(f"/api/v1/runs/{UNKNOWN_ID}/cancel", headers={"Authorization": "Bearer x"}), 403
    )
    assert count_runs(sql) == 0
    # reads need the token too, so with none configured only the probes and pages answer
    assert_json_error(api.get("/api/v1/runs"), 401)
    assert "reads are disabled" in assert_json_error(
        api.request("GET", "/api/v1/runs", headers={"Authorization": "Bearer x"}), 403
    )
    assert api.get("/health/live").status == 200


# ------------------------------------------------------------------ bad requests


def _cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


RECORD = {"workflow": "api-record", "input": {}}
RUNS = "/api/v1/runs"
REQUEUE = f"/api/v1/task-runs/{UNKNOWN_ID}/requeue"


def _x(value: bytes) -> bytes:
    """A run request whose input is ``{"x": <value>}``, as raw JSON text."""
    return b'{"workflow": "api-record", "input": {"x": ' + value + b"}}"


def case(
    name: str,
    method: str,
    path: str,
    body: Any = None,
    status: int | range = 400,
    headers: dict[str, str] | None = None,
) -> Any:
    return pytest.param(method, path, body, headers or {}, status, id=name)


BAD_REQUESTS = [
    case("malformed-json", "POST", RUNS, b'{"workflow": '),
    case("empty-body", "POST", RUNS, b""),
    case("not-utf8", "POST", RUNS, b"\xff\xfe\x00{"),
    case("body-is-a-list", "POST", RUNS, [RECORD]),
    case("body-is-a-string", "POST", RUNS, "api-record"),
    case("body-is-null", "POST", RUNS, b"null"),
    case("unknown-field", "POST", RUNS, {**RECORD, "colour": "red"}),
    case("missing-workflow", "POST", RUNS, {"input": {}}),
    case("workflow-not-a-string", "POST", RUNS, {"workflow": 5}),
    case("input-is-a-list", "POST", RUNS, {"workflow": "api-record", "input": [1]}),
    case("input-is-a-string", "POST", RUNS, {"workflow": "api-record", "input": "x"}),
    case("input-is-null", "POST", RUNS, {"workflow": "api-record", "input": None}),
    case("unknown-workflow", "POST", RUNS, {"workflow": "no-such-workflow"}, 422),
    case("key-template-cannot-format", "POST", RUNS, {"workflow": "api-keyed"}),
    case("idempotency-key-too-long", "POST", RUNS, RECORD, headers={"Idempotency-Key": "k" * 256}),
    case("run-id-malformed", "GET", f"{RUNS}/not-a-uuid"),
    case("run-id-unknown", "GET", f"{RUNS}/{UNKNOWN_ID}", status=404),
    case("cancel-id-malformed", "POST", f"{RUNS}/xyz/cancel"),
    case("cancel-id-unknown", "POST", f"{RUNS}/{UNKNOWN_ID}/cancel", status=404),
    case("requeue-id-malformed", "POST", "/api/v1/task-runs/12/requeue"),
    case("requeue-id-unknown", "POST", REQUEUE, status=404),
    case("requeue-body-a-list", "POST", REQUEUE, [1]),
    case("requeue-unknown-field", "POST", REQUEUE, {"why": "x"}),
    case("requeue-reason-not-a-string", "POST", REQUEUE, {"reason": 5}),
    case("requeue-malformed-json", "POST", REQUEUE, b"{"),
    case("unknown-path", "GET", "/api/v2/runs", status=404),
    case("unknown-root-path", "GET", "/nope", status=404),
    case("unknown-sub-path", "GET", f"{RUNS}/{UNKNOWN_ID}/tasks", status=404),
    case("delete-runs", "DELETE", RUNS, status=405),
    case("get-cancel", "GET", f"{RUNS}/{UNKNOWN_ID}/cancel", status=405),
    case("put-dead", "PUT", "/api/v1/dead", RECORD, 405),
    case("post-one-run", "POST", f"{RUNS}/{UNKNOWN_ID}", RECORD, 405),
    case("post-live", "POST", "/health/live", status=405),
    case("post-metrics", "POST", "/metrics", status=405),
    case("limit-zero", "GET", f"{RUNS}?limit=0"),
    case("limit-negative", "GET", f"{RUNS}?limit=-1"),
    case("limit-too-big", "GET", f"{RUNS}?limit=501"),
    case("limit-not-a-number", "GET", f"{RUNS}?limit=ten"),
    case("limit-fraction", "GET", f"{RUNS}?limit=1.5"),
    case("limit-empty", "GET", f"{RUNS}?limit="),
    case("dead-limit-zero", "GET", "/api/v1/dead?limit=0"),
    case("state-unknown", "GET", f"{RUNS}?state=SLEEPING"),
    case("state-empty", "GET", f"{RUNS}?state="),
    case("cursor-not-base64", "GET", f"{RUNS}?cursor=abc"),
    case("cursor-garbage", "GET", f"{RUNS}?cursor={_cursor('garbage')}"),
    case("cursor-bad-id", "GET", f"{RUNS}?cursor={_cursor('2024-01-01T00:00:00|x')}"),
    case("cursor-bad-time", "GET", f"{RUNS}?cursor={_cursor('yesterday|' + UNKNOWN_ID)}"),
    # input Python or PostgreSQL cannot take is still the client's mistake: a 4xx, not a 500/503
    case("limit-superscript-digit", "GET", f"{RUNS}?limit=%C2%B2"),
    case("dead-limit-superscript-digit", "GET", "/api/v1/dead?limit=%C2%B3"),
    case("deeply-nested-json", "POST", RUNS, b"[" * 100_000, ANY_4XX),
    case("integer-too-long", "POST", RUNS, _x(b"9" * 5000), ANY_4XX),
    case("input-nan", "POST", RUNS, _x(b"NaN"), ANY_4XX),
    case("input-infinity", "POST", RUNS, _x(b"-Infinity"), ANY_4XX),
    case("input-overflowing-float", "POST", RUNS, _x(b"1e400"), ANY_4XX),
    case("input-nul-character", "POST", RUNS, _x(b'"a\\u0000b"'), ANY_4XX),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), BAD_REQUESTS)
def test_a_bad_request_gets_a_json_4xx_never_a_500(
    api: Api,
    sql: Sql,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int | range,
) -> None:
    assert_json_error(api.request(method, path, body, headers=headers), status)
    assert count_runs(sql) == 0
    assert api.get("/health/live").status == 200


def test_a_405_names_the_allowed_methods(api: Api) -> None:
    reply = api.request("DELETE", "/api/v1/runs")
    assert_json_error(reply, 405)
    assert {"GET", "POST"} <= {m.strip() for m in reply.headers.get("Allow", "").split(",")}


def test_a_body_over_one_mib_is_refused_with_413(api: Api, sql: Sql) -> None:
    def padded(size: int) -> bytes:
        """A valid run request of exactly ``size`` bytes."""
        head, tail = b'{"workflow": "api-record", "input": {"pad": "', b'"}}'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    for size in (MIB + 1, 2 * MIB):
        # the server drains what it refused, so the answer is never lost to a reset
        assert "larger than" in assert_json_error(api.post("/api/v1/runs", padded(size)), 413)
        assert_json_error(api.post("/api/v1/runs", padded(size), chunked=True), 413)
    assert_json_error(api.post(REQUEUE, padded(MIB + 1)), 413)
    assert count_runs(sql) == 0
    at_limit = api.post("/api/v1/runs", padded(MIB))
    assert at_limit.status == 201, at_limit.body[:300]
    chunked = api.post("/api/v1/runs", padded(MIB - 10), chunked=True)
    assert chunked.status == 201, chunked.body[:300]
    assert count_runs(sql) == 2


def _raw_headers_only(api: Api, path: str, length: int) -> Reply:
    """Announce a ``length``-byte body, send none of it, and read whatever the server answers
    (a server that refuses on the header alone answers at once and closes)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as sock:
        sock.sendall(head.encode())
        sock.settimeout(5)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return Reply(response.status, response.headers, response.read())


def test_a_body_far_over_the_limit_is_still_a_json_413(api: Api, sql: Sql) -> None:
    """Above waitress's own cap (16 MiB) the answer must still be the JSON 413 of the contract."""
    assert_json_error(_raw_headers_only(api, RUNS, 17 * MIB), 413)
    assert_json_error(_raw_headers_only(api, REQUEUE, 17 * MIB), 413)
    assert count_runs(sql) == 0


def test_a_smaller_max_body_bytes_is_enforced(api_here: StartApi, sql: Sql) -> None:
    api = api_here(max_body_bytes=2048)
    small = api.post("/api/v1/runs", {"workflow": "api-record", "input": {"pad": "x" * 1500}})
    assert small.status == 201, small.body
    big = {"workflow": "api-record", "input": {"pad": "x" * 2100}}
    assert "2048" in assert_json_error(api.post("/api/v1/runs", big), 413)
    assert_json_error(api.post("/api/v1/runs", big, chunked=True), 413)
    assert_json_error(api.post(REQUEUE, {"reason": "x" * 2100}), 413)
    assert count_runs(sql) == 1


# ------------------------------------------------------------------ reading and listing runs


def test_get_run_has_the_same_shape_as_status_json(
    api: Api, clean_database_url: str, repo: Store, sql: Sql
) -> None:
    run = api.create("api-other", {"customer": "c-1"})
    dead_task = make_dead(repo, sql)  # a run with a failure reason and attempt history too
    dead_run = str(repo.get_task(dead_task).run_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = clean_database_url
    for run_id in (run["id"], dead_run):
        status = cli_runner.run(["-c", str(api.config), "status", run_id, "--json"], env, REPO)
        assert status.returncode == 0, status.stderr
        reply = api.get(f"/api/v1/runs/{run_id}")
        assert reply.status == 200
        assert reply.json() == json.loads(status.stdout)
    dead = api.get(f"/api/v1/runs/{dead_run}").json()
    assert dead["state"] == "FAILED"
    assert dead["tasks"][0]["failure_reason"] == "permanent_error"


def _walk(api: Api, query: str, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of ``/api/v1/runs?{query}`` following ``next_cursor``; bounded."""
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    for _ in range(100):
        path = f"/api/v1/runs?limit={limit}" + (f"&{query}" if query else "")
        reply = api.get(path + (f"&cursor={cursor}" if cursor else ""))
        assert reply.status == 200, reply.body
        data = reply.json()
        assert set(data) == {"runs", "next_cursor"}
        pages.append(data["runs"])
        cursor = data["next_cursor"]
        if cursor is None:
            return pages
        assert len(data["runs"]) == limit  # only a full page announces another
    raise AssertionError("pagination did not end")


def test_listing_filters_and_pages_every_run_exactly_once(
    api: Api, clean_database_url: str
) -> None:
    created = [api.create("api-record" if n % 5 else "api-other", {"n": n}) for n in range(25)]
    others = [r["id"] for r in created if r["workflow"] == "api-other"]
    cancelled = [r["id"] for r in created[1:4]]
    for run_id in cancelled:
        assert api.post(f"/api/v1/runs/{run_id}/cancel").status == 200
    newest_first = [r["id"] for r in reversed(created)]

    pages = _walk(api, "", 10)
    assert [len(p) for p in pages] == [10, 10, 5]
    walked = [r["id"] for page in pages for r in page]
    assert walked == newest_first  # each run exactly once, newest first
    assert all("tasks" not in r and {"id", "workflow", "state"} <= r.keys() for r in pages[0])

    by_workflow = [r["id"] for p in _walk(api, "workflow=api-other", 2) for r in p]
    assert by_workflow == [i for i in newest_first if i in others] and len(others) == 5
    by_state = [r["id"] for p in _walk(api, "state=cancelled", 2) for r in p]
    assert by_state == [i for i in newest_first if i in cancelled]
    pending_records = [r for p in _walk(api, "state=PENDING&workflow=api-record", 7) for r in p]
    assert {(r["workflow"], r["state"]) for r in pending_records} == {("api-record", "PENDING")}
    assert len(pending_records) == 25 - len(others) - len(cancelled)
    assert _walk(api, "workflow=no-such-workflow", 10) == [[]]

    default = api.get("/api/v1/runs").json()
    assert len(default["runs"]) == 25 and default["next_cursor"] is None


# ------------------------------------------------------------------ cancel, dead, requeue


def test_cancel_cancels_a_run(api: Api, clean_database_url: str) -> None:
    run = api.create("api-other")
    reply = api.post(f"/api/v1/runs/{run['id']}/cancel")
    assert reply.status == 200, reply.body
    cancelled = reply.json()
    assert cancelled["id"] == run["id"] and cancelled["state"] == "CANCELLED"
    assert cancelled["cancel_requested"] is True
    assert {(t["state"], t["failure_reason"]) for t in cancelled["tasks"]} == {
        ("CANCELLED", "cancelled")
    }
    assert api.get(f"/api/v1/runs/{run['id']}").json() == cancelled
    again = api.post(f"/api/v1/runs/{run['id']}/cancel")
    assert again.status < 500 and again.headers.get_content_type() == "application/json"


def test_dead_tasks_are_listed_and_requeued_once_with_an_audit_row(
    api: Api, repo: Store, sql: Sql
) -> None:
    assert api.get("/api/v1/dead").json() == {"tasks": [], "next_cursor": None}
    first, second = make_dead(repo, sql), make_dead(repo, sql)
    listed = api.get("/api/v1/dead").json()["tasks"]
    assert {t["id"] for t in listed} == {first, second}
    for task in listed:
        assert (task["state"], task["failure_reason"], task["attempt"]) == (
            "DEAD",
            "permanent_error",
            1,
        )
    assert len(api.get("/api/v1/dead?limit=1").json()["tasks"]) == 1

    body = {"reason": "upstream fixed", "requested_by": "alice"}
    reply = api.post(f"/api/v1/task-runs/{first}/requeue", body)
    assert reply.status == 200, reply.body
    requeued = reply.json()
    assert requeued["id"] == first and requeued["state"] == "PENDING"
    assert requeued["failure_reason"] is None
    assert "DEAD" in assert_json_error(api.post(f"/api/v1/task-runs/{first}/requeue", body), 409)
    assert api.post(f"/api/v1/task-runs/{second}/requeue").status == 200  # no body at all

    audit = sql.execute(
        "SELECT task_run_id::text, requested_by, reason, previous_reason, attempt"
        " FROM requeue_audit ORDER BY id"
    ).fetchall()
    assert audit == [
        (first, "alice", "upstream fixed", "permanent_error", 1),
        (second, "api", None, "permanent_error", 1),
    ]
    assert api.get("/api/v1/dead").json() == {"tasks": [], "next_cursor": None}


def test_a_requeue_reason_the_database_cannot_store_is_a_4xx(
    api: Api, repo: Store, sql: Sql
) -> None:
    dead = make_dead(repo, sql)
    reply = api.post(f"/api/v1/task-runs/{dead}/requeue", {"reason": "a\u0000b"})
    assert_json_error(reply, ANY_4XX)
    assert repo.get_task(dead).state is TaskState.DEAD


# ------------------------------------------------------------------ health


def _ready(api: Api) -> Reply:
    return api.request("GET", "/health/ready", auth=False, timeout=15)


@pytest.mark.slow  # real role processes
def test_ready_needs_a_scheduler_a_publisher_and_a_worker(api_stack: Stack) -> None:
    api = start_api(api_stack)
    scheduler, publisher, worker = api_stack.start_all(workers=1)
    assert api.get("/health/live").json() == {"status": "ok"}
    wait_for(
        lambda: _ready(api).status == 200,
        timeout=BOOT_TIMEOUT_S,
        interval=0.2,
        what=f"/health/ready to answer 200 (last: {_ready(api).body!r})",
    )
    ok = {
        "status": "ok",
        "postgres": "ok",
        "rabbitmq": "ok",
        "scheduler": "ok",
        "publisher": "ok",
        "worker": "ok",
    }
    ready = _ready(api)
    assert ready.headers.get_content_type() == "application/json"
    assert ready.json() == ok

    publisher.stop()  # a clean stop deregisters at once
    not_ready = wait_for(
        lambda: (r := _ready(api)).status == 503 and r,
        timeout=BOOT_TIMEOUT_S,
        interval=0.2,
        what="/health/ready to answer 503 without a publisher",
    )
    assert not_ready.json() == {**ok, "status": "error", "publisher": "error"}

    worker.stop()
    wait_for(
        lambda: _ready(api).json().get("worker") == "error",
        timeout=BOOT_TIMEOUT_S,
        interval=0.2,
        what="/health/ready to name the missing worker",
    )
    final = _ready(api)
    assert final.status == 503
    assert final.json() == {**ok, "status": "error", "publisher": "error", "worker": "error"}
    assert scheduler.alive()
    assert api.get("/health/live").status == 200


# ------------------------------------------------------------------ metrics under flowforge up


def _metrics(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by (name, labels); the text must parse."""
    reply = api.get("/metrics")
    assert reply.status == 200
    assert reply.headers.get_content_type() == "text/plain"
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _sum(samples: Mapping[tuple[str, Any], float], name: str) -> float:
    """A sample summed over its labels (the multiprocess collector may label by pid)."""
    return sum(v for (n, _labels), v in samples.items() if n == name)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def flowforge_up(stack: Stack, **settings: Any) -> Iterator[subprocess.Popen[bytes]]:
    """``flowforge up`` on ``stack``'s config; SIGTERM (then SIGKILL) it and its children."""
    config = stack.config_path(**settings)
    log = (stack.directory / "up.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
        cwd=REPO,
        env=stack.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    children: set[int] = set()
    try:
        yield proc
    finally:
        children.update(_children(proc.pid))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(UP_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in children:  # only if the supervisor failed to end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


@pytest.mark.slow  # real role processes
def test_metrics_parse_and_move_as_tasks_run_under_flowforge_up(api_stack: Stack) -> None:
    port = free_ports(1)[0]
    api_stack.extra_env = {TOKEN_ENV: TOKEN}
    settings = {**api_settings(api_stack.directory, port), "processes": {"workers": 1}}
    with flowforge_up(api_stack, **settings) as up:
        api = Api(port, TOKEN, api_stack.config_path(**settings))
        log = api_stack.directory / "up.log"
        wait_until_serving(api, lambda: up.poll() is None, lambda: log.read_text(errors="replace"))
        wait_for(
            lambda: _ready(api).status == 200,
            timeout=RUN_TIMEOUT_S,
            interval=0.2,
            what="the tree to be ready",
        )
        assert "tree" in _ready(api).json()  # under up the api reports its tree too

        before = _metrics(api)
        assert before[("flowforge_database_up", ())] == 1
        succeeded_before = _sum(before, "flowforge_tasks_succeeded_total")
        lag_before = _sum(before, "flowforge_dispatch_lag_seconds_count")

        runs = [api.create("api-record", {"n": n})["id"] for n in range(3)]
        for run_id in runs:
            wait_for(
                lambda run_id=run_id: (
                    api.get(f"/api/v1/runs/{run_id}").json()["state"] == "SUCCEEDED"
                ),
                timeout=RUN_TIMEOUT_S,
                interval=0.1,
                what=f"run {run_id} to succeed",
            )

        after = wait_for(
            lambda: (
                (m := _metrics(api))
                and _sum(m, "flowforge_tasks_succeeded_total") >= succeeded_before + 3
                and m
            ),
            timeout=10,
            interval=0.2,
            what="flowforge_tasks_succeeded_total to count the three tasks",
        )
        assert _sum(after, "flowforge_tasks_succeeded_total") == succeeded_before + 3
        assert after[("flowforge_task_runs", (("state", "SUCCEEDED"),))] == 3
        assert _sum(after, "flowforge_dispatch_lag_seconds_count") == lag_before + 3
        buckets = [
            v for (n, labels), v in after.items() if n == "flowforge_dispatch_lag_seconds_bucket"
        ]
        assert buckets and max(buckets) >= 3  # the +Inf bucket holds every observation
        assert _sum(after, "flowforge_tasks_started_total") >= 3
        assert after[("flowforge_processes", (("role", "worker"),))] >= 1
        assert up.poll() is None
