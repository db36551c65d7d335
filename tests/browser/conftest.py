"""Fixtures for the browser tests of the dashboard (docs/dashboard-contract.md).

- ``browser``: one headless Chromium per session — Debian's ``/usr/bin/chromium`` (installed by
  ``scripts/browser-deps``), driven by Playwright. Playwright's own browser download is never
  used. A missing or broken chromium skips locally and fails with ``CI=true``.
- ``page``: a fresh browser context (so an empty ``sessionStorage``) and page per test. Every
  test leaves ``test-artifacts/screenshots/<test name>.png`` (the page as the test ended, also
  when it failed; plus ``<test name>.html`` on failure); ``screenshot(label)`` adds
  ``<test name>--<label>.png`` on the way.
- ``dashboard``: a live stack for one test — scheduler, publisher, two workers and the ``api``
  role with a bearer token, on a fresh queue and the session database — with the dashboard's
  base URL and token, and a small HTTP client for setting up runs. Reads need the token
  (``api.read_access: token``, the default): ``dashboard.sign_in(page)`` puts it in the page's
  ``sessionStorage`` as the token field would. Indirect parametrization adds api settings:
  ``@pytest.mark.parametrize("dashboard", [{"read_access": "open"}], indirect=True)``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from playwright.sync_api import Browser, Page, expect, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from tests.e2e import REPO, RoleProcess, Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for

IN_CI = os.environ.get("CI", "").lower() == "true"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
TOKEN_ENV = "FLOWFORGE_API_TOKEN"
#: Where the dashboard keeps the token (flowforge/dashboard/static/app.js).
TOKEN_KEY = "flowforge.api-token"
#: Playwright's waits (actions, ``expect``): long enough for a 2 s live refresh and a busy CI.
UI_TIMEOUT_MS = 20_000
BOOT_TIMEOUT_S = 30.0
#: Two, so a task held open by a gate never stops the others of a test.
WORKERS = 2
HTTP_TIMEOUT_S = 30.0

expect.set_options(timeout=UI_TIMEOUT_MS)

#: A queue no worker of a dashboard stack consumes (ui-elsewhere's second task goes there; the
#: test that triggers it deletes the queue).
UNSERVED = "flowforge.ui.unserved"
#: The workflows every dashboard stack knows (written as YAML files into its config folder).
WORKFLOWS: dict[str, list[dict[str, Any]]] = {
    # two quick tasks, first -> second
    "ui-pair": [
        {"name": "first", "handler": "e2e.record"},
        {"name": "second", "handler": "e2e.record", "depends_on": ["first"]},
    ],
    # first succeeds, gated waits for the file input.gate, last waits for gated
    "ui-mixed": [
        {"name": "first", "handler": "e2e.record"},
        {"name": "gated", "handler": "e2e.gate", "depends_on": ["first"]},
        {"name": "last", "handler": "e2e.record", "depends_on": ["gated"]},
    ],
    # one task that runs until input.gate exists or the run is cancelled
    "ui-gate": [{"name": "only", "handler": "e2e.gate"}],
    # one task that writes input.text (log, stdout, stderr), reports progress, then waits for
    # input.gate
    "ui-talk": [{"name": "only", "handler": "e2e.talk"}],
    # one attempt that raises: DEAD at once
    "ui-fail": [{"name": "only", "handler": "e2e.fail", "retry": {"max_attempts": 1}}],
    # one attempt that raises until input.file exists: DEAD, then fixed and requeued
    "ui-fixable": [{"name": "only", "handler": "e2e.fail_until", "retry": {"max_attempts": 1}}],
    # a durable timer (no worker) before a quick task
    "ui-timer": [
        {"name": "nap", "sleep": "1h"},
        {"name": "after", "handler": "e2e.record", "depends_on": ["nap"]},
    ],
    # a map: one item per element of list's result ({"i", "label"} x input.n); the items in
    # input.fail die at once, the others succeed after input.item_s (the workflow is not
    # fail-fast, below)
    "ui-map": [
        {"name": "list", "handler": "e2e.labelled_items"},
        {
            "name": "process",
            "handler": "e2e.item_paced",
            "for_each": "list",
            "retry": {"max_attempts": 1},
        },
    ],
    # a child run (sub-workflows) of ui-gate: its task runs until input.gate exists
    "ui-parent": [{"name": "call", "workflow": "ui-gate"}],
    # a quick task, then one on a queue no worker of the stack consumes: it stays READY
    "ui-elsewhere": [
        {"name": "here", "handler": "e2e.record"},
        {"name": "away", "handler": "e2e.record", "depends_on": ["here"], "queue": UNSERVED},
    ],
    # the timeline (test_timeline.py): flaky fails (1 s backoff) until input.file exists, then
    # a map of input.n items of input.item_s seconds, then merge
    "ui-timeline": [
        {
            "name": "flaky",
            "handler": "e2e.fail_until",
            "retry": {"max_attempts": 5, "base_delay": 1, "max_delay": 1, "jitter": "none"},
        },
        {"name": "list", "handler": "e2e.labelled_items", "depends_on": ["flaky"]},
        {"name": "process", "handler": "e2e.item_paced", "for_each": "list"},
        {"name": "merge", "handler": "e2e.record", "depends_on": ["process"]},
    ],
    # a gated task with every flow-control key rendered from input.tenant: a second run of one
    # tenant waits for the first's concurrency slot
    "ui-keyed": [
        {
            "name": "call",
            "handler": "e2e.gate",
            "concurrency": {"key": "t-{tenant}", "limit": 1},
            "rate_limit": {"limit": 100, "per": "1s", "key": "r-{tenant}"},
            "circuit_breaker": {
                "failures": 5,
                "window": "60s",
                "cooldown": "30s",
                "key": "b-{tenant}",
            },
        }
    ],
}
#: Workflow keys besides ``tasks`` (by workflow name).
WORKFLOW_KEYS: dict[str, dict[str, Any]] = {"ui-map": {"fail_fast": False}}
#: Schedules of the workflows above, synced by the stack's scheduler when it starts: one name
#: with a slash (``ui-pair/0``, the default), a cron that fires once a year (1 January, 03:00
#: Berlin), so no test meets a fire it did not ask for. Its input holds markup the pages must
#: show as text.
SCHEDULE = "ui-pair/0"
SCHEDULE_MARKUP = "<b data-testid=injected>schedule</b>"
SCHEDULES: dict[str, list[dict[str, Any]]] = {
    "ui-pair": [
        {"cron": "0 3 1 1 *", "timezone": "Europe/Berlin", "input": {"from": SCHEDULE_MARKUP}}
    ],
}


def unavailable(message: str) -> None:
    """Skip locally, fail in CI: a missing browser must never turn CI green."""
    if IN_CI:
        pytest.fail(f"required browser missing in CI: {message}")
    pytest.skip(message)


# ------------------------------------------------------------------ the browser


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Headless Debian chromium through Playwright, for the whole session."""
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"{CHROMIUM} is missing: run scripts/browser-deps (Debian package chromium)")
    args = ["--disable-dev-shm-usage"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # chromium refuses to sandbox itself as root
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=args
            )
        except PlaywrightError as exc:
            unavailable(f"{CHROMIUM} did not start: {exc}")
        try:
            yield launched
        finally:
            launched.close()


#: Whether the page of a test was saved when its body ended.
_SAVED = pytest.StashKey[bool]()


def artifact_name(test_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", test_name).strip("_")


def save_page(page: Page, name: str, failed: bool) -> None:
    """``<name>.png`` (the whole page) and, for a failed test, ``<name>.html``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    if failed:
        (SCREENSHOTS / f"{name}.html").write_text(page.content())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Save the page the moment the test body ends, pass or fail: before any fixture
    teardown stops the stack under it (the page's live refreshes would then show errors)."""
    report: pytest.TestReport = yield
    page = getattr(item, "funcargs", {}).get("page")
    if report.when == "call" and isinstance(page, Page):
        try:
            save_page(page, artifact_name(item.name), report.failed)
            item.stash[_SAVED] = True
        except PlaywrightError:
            item.stash[_SAVED] = False  # the page fixture tries again, and insists
    return report


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A page in its own context. The test's page is saved when the test body ends (see
    ``pytest_runtest_makereport``); if that could not happen, at teardown."""
    name = artifact_name(request.node.name)
    for stale in [*SCREENSHOTS.glob(f"{name}.*"), *SCREENSHOTS.glob(f"{name}--*.png")]:
        stale.unlink()  # what an earlier run of this test left
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(UI_TIMEOUT_MS)
    opened = context.new_page()
    try:
        yield opened
        if not request.node.stash.get(_SAVED, False):
            save_page(opened, name, failed=True)
    finally:
        context.close()


@pytest.fixture
def screenshot(page: Page, request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """``screenshot(label)`` saves ``<test name>--<label>.png`` and returns its path."""

    def take(label: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{artifact_name(request.node.name)}--{artifact_name(label)}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take


# ------------------------------------------------------------------ the stack


@dataclass
class Dashboard:
    """A running stack whose api serves the dashboard at ``base_url``."""

    base_url: str
    port: int
    token: str
    stack: Stack
    api: RoleProcess
    processes: list[RoleProcess]
    #: A gate file for e2e.gate tasks (``{"gate": str(dashboard.gate)}``), opened at teardown
    #: so held workers drain at once instead of being killed after the stop timeout.
    gate: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def sign_in(self, page: Page) -> None:
        """Every page of the dashboard opened in ``page``'s context from now on starts with the
        token in ``sessionStorage`` (where the token field saves it), before its scripts run."""
        script = (
            f"if (location.origin === {json.dumps(self.base_url)}) "
            f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(self.token)});"
        )
        page.context.add_init_script(script)

    def request(
        self, method: str, path: str, body: Any = None, token: bool = True
    ) -> tuple[int, Any]:
        """One JSON request to the api (test setup), returning (status, decoded body)."""
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if token:
            headers["Authorization"] = f"Bearer {self.token}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        is_json = response.headers.get_content_type() == "application/json"
        return response.status, json.loads(raw) if is_json and raw else raw

    def trigger(self, workflow: str, run_input: dict[str, Any] | None = None, **timing: Any) -> str:
        """Start a run through the api (``timing``: ``start_at``, ``delay``, ``deadline`` as
        ``POST /api/v1/runs`` takes them); returns its id."""
        status, body = self.request(
            "POST", "/api/v1/runs", {"workflow": workflow, "input": run_input or {}, **timing}
        )
        assert status == 201, (status, body)
        return str(body["id"])


def write_workflows(directory: Path) -> Path:
    folder = directory / "workflows"
    folder.mkdir(exist_ok=True)
    for name, tasks in WORKFLOWS.items():
        document: dict[str, Any] = {"name": name, "tasks": tasks, **WORKFLOW_KEYS.get(name, {})}
        if name in SCHEDULES:
            document["schedules"] = SCHEDULES[name]
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(document))
    return folder


def _serving(port: int, api: RoleProcess) -> bool:
    assert api.alive(), f"the api process exited:\n{api.log()[-4000:]}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health/live")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@pytest.fixture
def dashboard(
    tmp_path: Path, clean_database_url: str, broker_url: str, request: pytest.FixtureRequest
) -> Iterator[Dashboard]:
    """Scheduler, publisher, two workers and the api (with a token) on the session database;
    an indirect parameter adds api settings."""
    extra_api: dict[str, Any] = getattr(request, "param", {})
    token = f"ui-test-{uuid.uuid4().hex}"
    stack = Stack(tmp_path, clean_database_url, broker_url)
    stack.extra_env = {TOKEN_ENV: token}
    gate = tmp_path / "gate-opened-at-teardown"
    port = free_ports(1)[0]
    settings: dict[str, Any] = {
        "workflows": [str(write_workflows(tmp_path))],
        "api": {"listen": f"127.0.0.1:{port}", "token_env": TOKEN_ENV, **extra_api},
    }
    try:
        api = stack.start("api", **settings)
        others = stack.start_all(workers=WORKERS, **settings)
        wait_for(
            lambda: _serving(port, api),
            timeout=BOOT_TIMEOUT_S,
            interval=0.1,
            what="the api to answer /health/live",
        )
        yield Dashboard(f"http://127.0.0.1:{port}", port, token, stack, api, [api, *others], gate)
    finally:
        gate.touch()
        stack.stop_all()
        stack.delete_queue()
