"""Talking to the api over HTTP in tests: a client (:class:`Api`, :class:`Reply`), the api
child of a :class:`~tests.e2e.Stack` (:func:`start_api`) or the api role on a thread of this
process (:func:`serve_here`), and the checks every api test shares (:func:`assert_json_error`).
Its fixtures (``api_here``, ``api_stack``) are in tests/integration/conftest.py."""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import RetryPolicy
from tests.api_here import ApiHere
from tests.e2e import RoleProcess, Stack
from tests.harness.resources import free_ports
from tests.helpers import bury, drain, task_ids, wait_for
from tests.store import Store

Sql = psycopg.Connection[tuple[Any, ...]]

TOKEN = f"api-test-{uuid.uuid4().hex}"
TOKEN_ENV = "FLOWFORGE_API_TOKEN"
MIB = 1024 * 1024
UNKNOWN_ID = "00000000-0000-0000-0000-000000000000"
HTTP_TIMEOUT_S = 30.0
BOOT_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 60.0
UP_STOP_TIMEOUT_S = 40.0
ANY_4XX = range(400, 500)

WORKFLOW_FILES = {
    "api-record.yaml": "name: api-record\ntasks:\n  - name: only\n    handler: e2e.record\n",
    "api-other.yaml": (
        "name: api-other\ntasks:\n"
        "  - name: first\n    handler: e2e.record\n"
        "  - name: second\n    handler: e2e.record\n    depends_on: [first]\n"
    ),
    "api-keyed.yaml": (
        "name: api-keyed\ntasks:\n"
        "  - name: only\n    handler: e2e.record\n    idempotency_key: 'order-{order_id}'\n"
    ),
}
PERMANENT = WorkflowDef("api-dead", (TaskDef("only", "e2e.permanent", retry=RetryPolicy(3)),))


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Api:
    """A running api child, addressed over HTTP."""

    port: int
    token: str | None
    config: Path
    process: RoleProcess | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        auth: bool = True,
        chunked: bool = False,
        timeout: float = HTTP_TIMEOUT_S,
    ) -> Reply:
        """One request on a fresh connection; ``body`` is bytes, or data sent as JSON."""
        sent = dict(headers or {})
        if auth and self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        payload: Any = body
        if body is not None and not isinstance(body, bytes | bytearray):
            payload = json.dumps(body).encode()
        if payload is not None:
            sent.setdefault("Content-Type", "application/json")
        if chunked and payload is not None:
            data = bytes(payload)
            payload = (data[i : i + 64 * 1024] for i in range(0, len(data), 64 * 1024))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=payload, headers=sent, encode_chunked=chunked)
            response = conn.getresponse()
            return Reply(response.status, response.headers, response.read())
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        """A read with the token (``api.read_access: token``, the default, needs it)."""
        return self.request("GET", path)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Reply:
        return self.request("POST", path, body, **kwargs)

    def create(self, workflow: str, run_input: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = self.post("/api/v1/runs", {"workflow": workflow, "input": run_input or {}})
        assert reply.status == 201, (reply.status, reply.body)
        data: dict[str, Any] = reply.json()
        return data


def write_workflows(directory: Path) -> Path:
    folder = directory / "workflows"
    folder.mkdir(exist_ok=True)
    for name, text in WORKFLOW_FILES.items():
        (folder / name).write_text(text)
    return folder


def api_settings(directory: Path, port: int, **api: Any) -> dict[str, Any]:
    return {
        "workflows": [str(write_workflows(directory))],
        "api": {"listen": f"127.0.0.1:{port}", "token_env": TOKEN_ENV, **api},
    }


def wait_until_serving(api: Api, alive: Any, log: Any, timeout: float = BOOT_TIMEOUT_S) -> None:
    """Poll ``/health/live`` until it answers 200; fail at once if the process died."""

    def probe() -> bool:
        assert alive(), f"the api process exited:\n{log()[-4000:]}"
        try:
            return api.request("GET", "/health/live", auth=False, timeout=2).status == 200
        except OSError:
            return False

    wait_for(probe, timeout=timeout, interval=0.1, what="the api to answer /health/live")


def start_api(stack: Stack, token: str | None = TOKEN, **api: Any) -> Api:
    """``flowforge role api`` from ``stack`` (same queue) on a free port, serving."""
    port = free_ports(1)[0]
    stack.extra_env = {TOKEN_ENV: token} if token is not None else {}
    settings = api_settings(stack.directory, port, **api)
    process = stack.start("api", **settings)
    found = Api(port, token, stack.config_path(**settings), process)
    wait_until_serving(found, process.alive, process.log)
    return found


@contextmanager
def module_api(directory: Path, database_url: str, broker_url: str) -> Iterator[Api]:
    """One api child (token set, default config) on a :class:`Stack` of its own in
    ``directory``, for the tests of a module that need no particular config; stopped, and its
    queue deleted, at the end."""
    stack = Stack(directory, database_url, broker_url)
    try:
        yield start_api(stack)
    finally:
        stack.stop_all()
        stack.delete_queue()


def assert_json_error(reply: Reply, status: int | range | tuple[int, ...]) -> str:
    """``status`` (one, or any of several) with a body of exactly ``{"error": "<message>"}``."""
    expected = (status,) if isinstance(status, int) else status
    assert reply.status in expected, (reply.status, reply.body[:500])
    assert b"Traceback" not in reply.body and b'File "' not in reply.body, reply.body[:500]
    assert reply.headers.get_content_type() == "application/json", reply.headers
    data = reply.json()
    assert isinstance(data, dict) and set(data) == {"error"}, data
    assert isinstance(data["error"], str) and data["error"], data
    return data["error"]


def assert_json_ok(reply: Reply) -> Any:
    """A 200 with a JSON body; the body decoded."""
    assert reply.status == 200, (reply.status, reply.body[:500])
    assert reply.headers.get_content_type() == "application/json", reply.headers
    return reply.json()


def count_runs(sql: Sql) -> int:
    row = sql.execute("SELECT count(*) FROM workflow_runs").fetchone()
    assert row is not None
    return int(row[0])


def make_dead(repo: Store, sql: Sql) -> str:
    """A task run buried DEAD by a permanent error, driven through the repository."""
    run_id = repo.trigger(PERMANENT).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    bury(repo, sql, task_id, error="this input can never work")
    return str(task_id)


StartApi = Callable[..., Api]


def write_config(
    directory: Path, database_url: str, workflows: Mapping[str, str], **sections: Any
) -> Path:
    """``directory/flowforge.yaml``: the database, a folder of ``workflows`` (file name →
    YAML text), an api on a free port whose token is read from ``TOKEN_ENV``, and any more
    top-level ``sections``. For the CLI (tests/cli_runner.py ``run_config``) and
    :func:`serve_config`."""
    folder = directory / "workflows"
    folder.mkdir(exist_ok=True)
    for name, text in workflows.items():
        (folder / name).write_text(text)
    port = free_ports(1)[0]
    config = directory / "flowforge.yaml"
    settings = {
        "database": {"url": database_url},
        "workflows": [str(folder)],
        "api": {"listen": f"127.0.0.1:{port}", "token_env": TOKEN_ENV},
        **sections,
    }
    config.write_text(json.dumps(settings))
    return config


@contextmanager
def serve_config(config: Path) -> Iterator[Api]:
    """The api role of ``config`` (with the token ``TOKEN``) on a thread of this process
    (tests/api_here.py), serving until the block ends."""
    server = ApiHere(load_config(config, env={TOKEN_ENV: TOKEN}))
    server.start()
    try:
        yield Api(server.port, TOKEN, config)
    finally:
        server.stop()


def serve_here(stack: Stack, token: str | None = TOKEN, **api: Any) -> tuple[Api, ApiHere]:
    """The api role on a thread of this process (tests/api_here.py) with ``stack``'s config and
    ``api`` settings, serving on a free port; the caller stops it."""
    port = free_ports(1)[0]
    path = stack.config_path(**api_settings(stack.directory, port, **api))
    server = ApiHere(load_config(path, env={} if token is None else {TOKEN_ENV: token}))
    server.start()
    return Api(port, token, path), server


@contextmanager
def serve_stack(directory: Path, database_url: str, broker_url: str) -> Iterator[Api]:
    """The api role of a fresh :class:`Stack` in ``directory`` on a thread of this process
    (:func:`serve_here`), serving until the block ends: a module's ``api`` fixture."""
    found, server = serve_here(Stack(directory, database_url, broker_url))
    try:
        yield found
    finally:
        server.stop()


def ok(reply: Reply) -> Any:
    """A 200 reply's JSON body (anything else fails, showing the start of the body)."""
    assert reply.status == 200, (reply.status, reply.body[:500])
    return reply.json()
