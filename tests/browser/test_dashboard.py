"""The dashboard in a real browser (headless Chromium) against a live stack.

Each test starts scheduler, publisher, two workers and the api (``dashboard`` fixture), drives the
pages only through the selectors of docs/dashboard-contract.md, and checks what the page shows
against the database. Proven here:

- a page opened without the token (reads need it by default) asks for it in the token field
  instead of showing a broken page, and shows its data once the token is saved;
- ``/`` leads to the overview, whose run and task counts are the database's;
- the runs list filters by workflow (and state), shows new runs live, a run opens from it, and
  its DAG shows each task's state and edges, and follows the run live;
- a dead task's panel shows its traceback, as text (markup in an error is never rendered);
- a running run is cancelled from its page with the token (kept in ``sessionStorage`` only);
- a dead task is requeued from the dead page with a reason (audited) and runs again;
- requeue-all's dry run counts exactly the filtered dead tasks and changes nothing until
  confirmed; the confirmed requeue touches those and no others;
- with ``api.read_access: open``, without the token an action (cancel, requeue, pause, run
  now) shows the api's error and changes nothing;
- forged requests from another origin, same-site and cross-site (url-encoded and text/plain
  forms, a no-cors fetch), are refused by the CSRF guard (403/415) and cancel nothing;
- the processes page lists the stack's processes (pid, role, host), as registered;
- the schedules page lists a schedule synced from a workflow file with its next fire time (the
  database's); Pause and Resume change its state in the database; Run now starts a run whose
  page names the schedule and fire time and links back to the schedule's decisions;
- a delayed run is listed SCHEDULED with its start time (the state filter offers SCHEDULED) and
  is cancelled from its page before anything of it ran; a sleeping timer shows when it wakes;
- a run past its deadline shows FAILED with ``deadline_exceeded`` and its deadline, in the
  list and on its page;
- a task's queue shows in its panel, and the overview's Queues card flags a queue with READY
  tasks and no live consumer (issue 20; docs/flow-control.md);
- a map task's node opens its items: the database's counts by state, then pages of 50 in item
  order (next, previous, a state filter), each item's state, attempts and failure reason, its
  markup shown as text; the page never asks for more than a page of items.

Every wait is a poll with a deadline (Playwright's ``expect`` or ``tests.helpers.wait_for``).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Dialog, Locator, Page, Request, expect

from flowforge.domain.states import RunState, TaskState
from tests.browser.conftest import (
    SCHEDULE,
    SCHEDULE_MARKUP,
    UI_TIMEOUT_MS,
    UNSERVED,
    Dashboard,
)
from tests.delivery import broker_channel
from tests.helpers import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow]

Sql = psycopg.Connection[tuple[Any, ...]]
Shot = Callable[[str], Path]

RUN_TIMEOUT_S = 60.0
UI_TIMEOUT_S = UI_TIMEOUT_MS / 1000
#: The CSRF refusals of the contract (403 another origin/site, 415 a form body): not a 401,
#: so the forged requests are stopped by the CSRF guard itself, not only by the missing token.
CSRF_REFUSED = (403, 415)


# ------------------------------------------------------------------ database probes


def run_state(sql: Sql, run_id: str) -> str:
    row = sql.execute("SELECT state FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None, f"no run {run_id}"
    return str(row[0])


def task_states(sql: Sql, run_id: str) -> dict[str, str]:
    rows = sql.execute("SELECT name, state FROM task_runs WHERE run_id = %s", (run_id,))
    return {str(name): str(state) for name, state in rows.fetchall()}


def task_id(sql: Sql, run_id: str, name: str = "only") -> str:
    row = sql.execute(
        "SELECT id::text FROM task_runs WHERE run_id = %s AND name = %s", (run_id, name)
    ).fetchone()
    assert row is not None, f"run {run_id} has no task {name}"
    return str(row[0])


def task_state(sql: Sql, task_run_id: str) -> str:
    row = sql.execute("SELECT state FROM task_runs WHERE id = %s", (task_run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def executions(sql: Sql, task_run_id: str) -> int:
    row = sql.execute(
        "SELECT count(*) FROM test_executions WHERE task_run_id = %s", (task_run_id,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def audit_rows(sql: Sql) -> list[tuple[str, str | None]]:
    rows = sql.execute("SELECT task_run_id::text, reason FROM requeue_audit ORDER BY id")
    return [(str(tid), reason) for tid, reason in rows.fetchall()]


def counts(sql: Sql, table: str) -> dict[str, int]:
    rows = sql.execute(f"SELECT state, count(*) FROM {table} GROUP BY state").fetchall()
    return {str(state): int(n) for state, n in rows}


def wait_run(sql: Sql, run_id: str, state: str) -> None:
    wait_for(
        lambda: run_state(sql, run_id) == state,
        timeout=RUN_TIMEOUT_S,
        interval=0.05,
        what=f"run {run_id} to be {state} (it is {run_state(sql, run_id)})",
    )


def wait_task(sql: Sql, run_id: str, name: str, state: str) -> str:
    tid = task_id(sql, run_id, name)
    wait_for(
        lambda: task_state(sql, tid) == state,
        timeout=RUN_TIMEOUT_S,
        interval=0.05,
        what=f"task {name} of run {run_id} to be {state}",
    )
    return tid


def cancel_requested(sql: Sql, run_id: str) -> bool:
    row = sql.execute(
        "SELECT cancel_requested_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def run_row(sql: Sql, run_id: str) -> dict[str, Any]:
    """The run's timing columns, as stored."""
    cur = sql.execute(
        "SELECT state, schedule, fire_time, start_at, deadline_at, failure_reason"
        " FROM workflow_runs WHERE id = %s",
        (run_id,),
    )
    row = cur.fetchone()
    assert row is not None and cur.description is not None, f"no run {run_id}"
    return {column.name: value for column, value in zip(cur.description, row, strict=True)}


def schedule_row(sql: Sql, name: str) -> tuple[bool, datetime | None, str | None]:
    """(paused, next fire time, last run id) of schedule ``name``, as stored."""
    row = sql.execute(
        "SELECT paused, next_fire_at, last_run_id::text FROM schedules WHERE name = %s", (name,)
    ).fetchone()
    assert row is not None, f"no schedule {name}"
    return bool(row[0]), row[1], row[2]


def wait_paused(sql: Sql, name: str, paused: bool) -> None:
    wait_for(
        lambda: schedule_row(sql, name)[0] is paused,
        timeout=UI_TIMEOUT_S,
        interval=0.05,
        what=f"schedule {name} to be {'paused' if paused else 'active'} in the database",
    )


# ------------------------------------------------------------------ page helpers


def save_token(page: Page, token: str) -> None:
    page.locator("input[data-testid=token]").fill(token)
    page.locator("[data-testid=save-token]").click()


def accept_dialogs(page: Page) -> list[str]:
    """Accept every dialog (the confirm() of an action); returns the types seen, live."""
    seen: list[str] = []

    def accept(dialog: Dialog) -> None:
        seen.append(dialog.type)
        dialog.accept()

    page.on("dialog", accept)
    return seen


def posts_to(page: Page, pattern: str) -> list[Request]:
    """The POST requests the page sends whose URL matches ``pattern``, recorded live."""
    sent: list[Request] = []

    def note(request: Request) -> None:
        if request.method == "POST" and re.search(pattern, request.url):
            sent.append(request)

    page.on("request", note)
    return sent


def attribute_values(locator: Locator, name: str) -> set[str]:
    values = locator.evaluate_all(f"els => els.map(e => e.getAttribute({json.dumps(name)}))")
    return {str(v) for v in values}


def expect_ids(locator: Locator, name: str, expected: set[str]) -> None:
    """Poll until the elements of ``locator`` carry exactly ``expected`` in attribute ``name``."""
    wait_for(
        lambda: attribute_values(locator, name) == expected,
        timeout=UI_TIMEOUT_S,
        interval=0.1,
        what=f"{name} values {sorted(expected)} (shown: {sorted(attribute_values(locator, name))})",
    )


def expect_count(page: Page, testid: str, expected: int) -> None:
    """``[data-testid=<testid>]`` shows ``expected``; a zero may also be left out."""
    found = page.locator(f"[data-testid={testid}]")
    if expected:
        expect(found).to_have_text(str(expected))
    elif found.count():
        expect(found).to_have_text("0")


def most_first(found: dict[str, int], states: Iterable[str]) -> list[str]:
    """``states`` ordered by their count in ``found``, largest first."""
    return sorted(states, key=lambda state: -found.get(state, 0))


def shown_instant(locator: Locator) -> datetime:
    """The instant a ``<time>`` element shows (its ``datetime`` attribute, ISO 8601)."""
    expect(locator).to_have_attribute("datetime", re.compile(r"\d{4}-"))
    value = locator.get_attribute("datetime")
    assert value is not None
    return datetime.fromisoformat(value)


def dag_node(page: Page, name: str) -> Locator:
    return page.locator(f'svg[data-testid=dag] g[data-task="{name}"]')


def expect_dag_matches(page: Page, sql: Sql, run_id: str) -> dict[str, str]:
    states = task_states(sql, run_id)
    expect(page.locator("svg[data-testid=dag] g[data-task]")).to_have_count(len(states))
    for name, state in states.items():
        expect(dag_node(page, name)).to_have_attribute("data-state", state)
    return states


# ------------------------------------------------------------------ the token to read


def test_a_page_without_the_token_asks_for_it_and_shows_its_data_once_given(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    run_id = dashboard.trigger("ui-pair")
    wait_run(sql, run_id, "SUCCEEDED")
    reads: list[int] = []
    page.on(
        "response",
        lambda r: reads.append(r.status) if "/api/v1/runs?" in r.url else None,
    )
    page.goto(dashboard.url("/ui/runs"))
    flash = page.locator("[data-testid=flash]")
    field = page.locator("input[data-testid=token]")
    expect(flash).to_contain_text("This page needs the API token")
    expect(flash).to_contain_text("Error 401: a bearer token is required")
    expect(flash).to_have_attribute("data-kind", "error")
    expect(field).to_have_attribute("aria-invalid", "true")
    expect(field).to_be_focused()
    expect(page.locator("tr[data-run-id]")).to_have_count(0)
    expect(page.locator("[data-testid=runs-table]")).to_be_visible()  # the page itself is whole
    screenshot("asks-for-the-token")
    assert reads and set(reads) == {401}, reads

    save_token(page, "not-the-token")
    expect(flash).to_contain_text("the saved token was refused")
    expect(flash).to_contain_text("Error 403: invalid token")
    expect(field).to_have_attribute("aria-invalid", "true")

    save_token(page, dashboard.token)
    expect(page.locator(f'tr[data-run-id="{run_id}"]')).to_be_visible()
    expect(field).not_to_have_attribute("aria-invalid", "true")
    expect(flash).to_have_text("Token saved for this browser tab.")
    assert reads[-1] == 200, reads
    screenshot("token-given")


# ------------------------------------------------------------------ overview and runs


def test_overview_counts_match_the_database(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    pairs = [dashboard.trigger("ui-pair") for _ in range(3)]
    failed = dashboard.trigger("ui-fail")
    gated = dashboard.trigger("ui-gate", {"gate": str(dashboard.gate)})
    for run_id in pairs:
        wait_run(sql, run_id, "SUCCEEDED")
    wait_run(sql, failed, "FAILED")
    wait_task(sql, gated, "only", "RUNNING")
    runs, tasks = counts(sql, "workflow_runs"), counts(sql, "task_runs")
    assert runs == {"SUCCEEDED": 3, "FAILED": 1, "RUNNING": 1}, runs
    assert tasks == {"SUCCEEDED": 6, "DEAD": 1, "RUNNING": 1}, tasks

    page.goto(dashboard.url("/"))  # the root redirects to the overview
    expect(page).to_have_url(dashboard.url("/ui/"))
    expect(page.locator("[data-testid=overview]")).to_be_visible()
    # the numbers first (they wait for the page to load), then the zeros
    for kind, found, states in (("run", runs, list(RunState)), ("task", tasks, list(TaskState))):
        for state in most_first(found, map(str, states)):
            expect_count(page, f"{kind}-count-{state}", found.get(state, 0))
    for panel in (
        "retry-backlog",
        "poison-candidates",
        "dead-by-reason",
        "outbox-lag",
        "processes-summary",
    ):
        expect(page.locator(f"[data-testid={panel}]")).to_be_attached()
    chart = page.locator("[data-testid=throughput-chart]")
    expect(chart).to_be_visible()
    assert chart.evaluate("e => e.tagName.toLowerCase() === 'svg' || !!e.querySelector('svg')")
    reason = sql.execute("SELECT failure_reason FROM task_runs WHERE state = 'DEAD'").fetchone()
    assert reason is not None and reason[0]
    expect(page.locator("[data-testid=dead-by-reason]")).to_contain_text(str(reason[0]))
    for link in ("nav-overview", "nav-runs", "nav-dead", "nav-processes"):
        expect(page.locator(f"[data-testid={link}]")).to_be_visible()
    screenshot("overview")


def test_runs_list_filters_by_workflow_and_a_run_shows_its_dag(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    gate, opened = dashboard.gate, tmp_path / "open"
    opened.touch()
    others = [dashboard.trigger("ui-pair") for _ in range(2)]
    for run_id in others:
        wait_run(sql, run_id, "SUCCEEDED")
    done = dashboard.trigger("ui-mixed", {"gate": str(opened)})
    wait_run(sql, done, "SUCCEEDED")
    chosen = dashboard.trigger("ui-mixed", {"gate": str(gate)})
    wait_task(sql, chosen, "gated", "RUNNING")
    mixed = [done, chosen]

    page.goto(dashboard.url("/ui/"))
    page.locator("[data-testid=nav-runs]").click()
    expect(page).to_have_url(re.compile(r"/ui/runs(?:[?#].*)?$"))
    rows = page.locator("[data-testid=runs-table] tr[data-run-id]")
    expect_ids(rows, "data-run-id", {*others, *mixed})

    page.locator("input[name=workflow]").fill("ui-mixed")
    page.locator("[data-testid=apply-filters]").click()
    expect_ids(rows, "data-run-id", set(mixed))
    # the list is live: a new run of the workflow shows up without a reload
    late = dashboard.trigger("ui-mixed", {"gate": str(opened)})
    expect_ids(rows, "data-run-id", {*mixed, late})
    wait_run(sql, late, "SUCCEEDED")
    # and the filters combine: finished runs of the workflow, then every state again
    page.locator("select[name=state]").select_option("SUCCEEDED")
    page.locator("[data-testid=apply-filters]").click()
    expect_ids(rows, "data-run-id", {done, late})
    page.locator("select[name=state]").select_option("")
    page.locator("[data-testid=apply-filters]").click()
    expect_ids(rows, "data-run-id", {*mixed, late})
    row = page.locator(f'tr[data-run-id="{chosen}"]')
    expect(row.locator("[data-testid=run-state]")).to_have_text(run_state(sql, chosen))
    screenshot("runs-filtered")

    row.locator("a[data-testid=run-link]").click()
    expect(page).to_have_url(re.compile(rf"/ui/runs/{chosen}(?:[/?#].*)?$"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    states = expect_dag_matches(page, sql, chosen)
    assert states == {"first": "SUCCEEDED", "gated": "RUNNING", "last": "PENDING"}, states
    for edge in ("first->gated", "gated->last"):
        expect(page.locator(f'svg[data-testid=dag] path[data-edge="{edge}"]')).to_have_count(1)
    screenshot("dag-running")

    # the page follows the run live: open the gate, and the DAG turns green by itself
    gate.touch()
    wait_run(sql, chosen, "SUCCEEDED")
    expect(page.locator("[data-testid=run-state]")).to_have_text("SUCCEEDED")
    assert expect_dag_matches(page, sql, chosen) == dict.fromkeys(states, "SUCCEEDED")


def test_a_dead_tasks_panel_shows_its_traceback_as_text(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    # the error names this file: markup in it must be shown, never rendered or run
    payload = "<img src=x onerror=\"alert('xss')\"><b data-testid=injected>bold</b>"
    missing = tmp_path / payload
    run_id = dashboard.trigger("ui-fixable", {"file": str(missing)})
    wait_run(sql, run_id, "FAILED")
    tid = wait_task(sql, run_id, "only", "DEAD")
    attempt = sql.execute(
        "SELECT error, traceback FROM task_attempts WHERE task_run_id = %s", (tid,)
    ).fetchall()
    assert len(attempt) == 1 and attempt[0][1], attempt
    error, traceback = str(attempt[0][0]), str(attempt[0][1])
    assert "does not exist yet" in traceback and payload in traceback

    dialogs = accept_dialogs(page)
    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("FAILED")
    expect(dag_node(page, "only")).to_have_attribute("data-state", "DEAD")
    dag_node(page, "only").click()
    panel = page.locator("[data-testid=task-panel]")
    expect(panel).to_be_visible()
    expect(panel.locator("[data-testid=task-state]")).to_have_text("DEAD")
    expect(panel.locator("[data-testid=attempt]")).to_have_count(1)
    shown = panel.locator("pre[data-testid=traceback]")
    expect(shown).to_contain_text(f"RuntimeError: {missing} does not exist yet")
    expect(shown).to_contain_text("raise RuntimeError(f\"{ctx.input['file']} does not exist")
    expect(panel.locator("pre[data-testid=error]")).to_contain_text(payload)
    assert error.strip() and payload in error
    task_input = panel.locator("pre[data-testid=task-input]")
    expect(task_input).to_contain_text("<b data-testid=injected>bold</b>")
    assert json.loads(task_input.inner_text()) == {"file": str(missing)}
    shown.scroll_into_view_if_needed()
    screenshot("traceback")
    expect(page.locator("[data-testid=injected]")).to_have_count(0)
    assert dialogs == [], f"markup from an error ran in the page: {dialogs}"


# ------------------------------------------------------------------ actions with the token


def test_cancel_a_running_run_from_its_page(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    run_id = dashboard.trigger("ui-gate", {"gate": str(dashboard.gate)})
    wait_task(sql, run_id, "only", "RUNNING")

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    save_token(page, dashboard.token)  # the page asks for it: reading needs it too
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    wait_for(
        lambda: dashboard.token in page.evaluate("() => Object.values(sessionStorage)"),
        timeout=UI_TIMEOUT_S,
        interval=0.1,
        what="the token to be kept in sessionStorage",
    )
    assert page.evaluate("() => localStorage.length") == 0, "the token leaked to localStorage"
    assert page.context.cookies() == [], "the dashboard set a cookie"
    dialogs = accept_dialogs(page)
    cancels = posts_to(page, rf"/api/v1/runs/{run_id}/cancel$")
    page.locator("[data-testid=cancel-run]").click()

    expect(page.locator("[data-testid=run-state]")).to_have_text("CANCELLED")
    screenshot("cancelled")
    assert dialogs == ["confirm"], dialogs
    assert len(cancels) == 1
    assert cancels[0].all_headers().get("authorization") == f"Bearer {dashboard.token}"
    wait_run(sql, run_id, "CANCELLED")
    assert cancel_requested(sql, run_id)
    wait_task(sql, run_id, "only", "CANCELLED")


def test_requeue_a_dead_task_with_a_reason_runs_it_again(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    fix = tmp_path / "fixed"
    run_id = dashboard.trigger("ui-fixable", {"file": str(fix)})
    tid = wait_task(sql, run_id, "only", "DEAD")
    assert executions(sql, tid) == 1
    reason = f"input file restored ({uuid.uuid4().hex[:8]})"

    page.goto(dashboard.url("/ui/dead"))
    save_token(page, dashboard.token)
    accept_dialogs(page)
    requeues = posts_to(page, r"/api/v1/(task-runs/[^/]+/requeue|dead/requeue)$")
    row = page.locator(f'tr[data-task-id="{tid}"]')
    expect(row).to_be_visible()
    fix.touch()
    # a reason is required: without one nothing is sent
    page.locator("input[name=requeue-reason]").fill("")
    row.locator("[data-testid=requeue-one]").click()
    page.locator("input[name=requeue-reason]").fill(reason)
    row.locator("[data-testid=requeue-one]").click()

    expect(page.locator("[data-testid=flash]")).not_to_have_text(re.compile(r"^\s*$"))
    wait_task(sql, run_id, "only", "SUCCEEDED")
    screenshot("requeued")
    assert [r.url for r in requeues] == [dashboard.url(f"/api/v1/task-runs/{tid}/requeue")]
    assert audit_rows(sql) == [(tid, reason)]
    assert executions(sql, tid) == 2
    wait_run(sql, run_id, "SUCCEEDED")

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("SUCCEEDED")
    expect(dag_node(page, "only")).to_have_attribute("data-state", "SUCCEEDED")
    page.goto(dashboard.url("/ui/dead"))
    expect(page.locator("[data-testid=nav-dead]")).to_be_visible()
    expect(page.locator("tr[data-task-id]")).to_have_count(0)


def test_rerun_a_failed_run_from_its_page_with_a_reason(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    fix = tmp_path / "fixed"
    run_id = dashboard.trigger("ui-fixable", {"file": str(fix)})
    tid = wait_task(sql, run_id, "only", "DEAD")
    wait_run(sql, run_id, "FAILED")
    reason = f"input restored ({uuid.uuid4().hex[:8]})"

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    save_token(page, dashboard.token)
    expect(page.locator("[data-testid=run-state]")).to_have_text("FAILED")
    expect(page.locator("[data-testid=cancel-run]")).to_be_hidden()
    prompts: list[str] = []

    def answer(dialog: Dialog) -> None:
        prompts.append(dialog.type)
        dialog.accept(reason)

    page.on("dialog", answer)
    reruns = posts_to(page, rf"/api/v1/runs/{run_id}/rerun$")
    fix.touch()
    page.locator("[data-testid=rerun-run]").click()

    wait_run(sql, run_id, "SUCCEEDED")
    expect(page.locator("[data-testid=run-state]")).to_have_text("SUCCEEDED")
    expect(page.locator("[data-testid=rerun-run]")).to_be_hidden()
    screenshot("rerun")
    assert prompts == ["prompt"] and len(reruns) == 1
    assert executions(sql, tid) == 2
    audit = sql.execute("SELECT requested_by, reason, task_names FROM rerun_audit").fetchall()
    assert audit == [("dashboard", reason, ["only"])]


def test_requeue_all_dry_run_counts_the_matches_and_changes_nothing_until_confirmed(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    failing = [dashboard.trigger("ui-fail", {"n": n}) for n in range(3)]
    other = dashboard.trigger("ui-fixable", {"file": str(tmp_path / "never")})
    targets = {wait_task(sql, run_id, "only", "DEAD") for run_id in failing}
    bystander = wait_task(sql, other, "only", "DEAD")
    before = counts(sql, "task_runs")
    assert before == {"DEAD": 4}, before
    reason = f"bulk retry ({uuid.uuid4().hex[:8]})"

    page.goto(dashboard.url("/ui/dead"))
    save_token(page, dashboard.token)
    dialogs = accept_dialogs(page)
    bulk = posts_to(page, r"/api/v1/dead/requeue$")
    rows = page.locator("tr[data-task-id]")
    expect_ids(rows, "data-task-id", {*targets, bystander})
    page.locator("input[name=workflow]").fill("ui-fail")
    page.locator("[data-testid=apply-filters]").click()
    expect_ids(rows, "data-task-id", targets)
    page.locator("input[name=requeue-reason]").fill(reason)
    page.locator("[data-testid=requeue-all]").click()

    expect(page.locator("[data-testid=dry-run-count]")).to_have_text(str(len(targets)))
    expect(page.locator("[data-testid=confirm-requeue-all]")).to_be_visible()
    screenshot("dry-run")
    assert len(bulk) == 1, [r.post_data for r in bulk]
    dry = json.loads(bulk[0].post_data or "{}")
    assert dry.get("dry_run") is True and dry.get("workflow") == "ui-fail", dry
    assert bulk[0].response() is not None  # answered: whatever it did is done
    assert counts(sql, "task_runs") == before
    assert audit_rows(sql) == []
    assert all(executions(sql, tid) == 1 for tid in [*targets, bystander])

    page.locator("[data-testid=confirm-requeue-all]").click()
    wait_for(
        lambda: len(audit_rows(sql)) == len(targets),
        timeout=UI_TIMEOUT_S,
        what="three audit rows",
    )
    assert sorted(audit_rows(sql)) == sorted((tid, reason) for tid in targets)
    confirmed = json.loads(bulk[-1].post_data or "{}")
    assert len(bulk) == 2 and confirmed.get("dry_run") is not True, confirmed
    # requeued: each runs once more (and, still failing, dies again)
    wait_for(
        lambda: all(executions(sql, t) == 2 and task_state(sql, t) == "DEAD" for t in targets),
        timeout=RUN_TIMEOUT_S,
        what="each requeued task to run once more and die again",
    )
    assert task_state(sql, bystander) == "DEAD" and executions(sql, bystander) == 1
    expect(page.locator("[data-testid=flash]")).not_to_have_text(re.compile(r"^\s*$"))
    screenshot("confirmed")
    assert set(dialogs) <= {"confirm"}, dialogs


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("dashboard", [{"read_access": "open"}], indirect=True)
def test_without_the_token_an_action_shows_an_error_and_changes_nothing(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dead = wait_task(sql, dashboard.trigger("ui-fail"), "only", "DEAD")
    running = dashboard.trigger("ui-gate", {"gate": str(dashboard.gate)})
    wait_task(sql, running, "only", "RUNNING")
    accept_dialogs(page)
    flash = page.locator("[data-testid=flash]")
    refusal = re.compile(r"token|401|403|unauthori[sz]ed|forbidden", re.IGNORECASE)

    page.goto(dashboard.url(f"/ui/runs/{running}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    page.locator("[data-testid=cancel-run]").click()
    expect(flash).to_contain_text(refusal)
    screenshot("cancel-refused")
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    assert run_state(sql, running) == "RUNNING" and not cancel_requested(sql, running)
    assert task_states(sql, running) == {"only": "RUNNING"}

    page.goto(dashboard.url("/ui/dead"))
    expect(page.locator(f'tr[data-task-id="{dead}"]')).to_be_visible()
    page.locator("input[name=requeue-reason]").fill("no token, no requeue")
    page.locator(f'tr[data-task-id="{dead}"] [data-testid=requeue-one]').click()
    expect(flash).to_contain_text(refusal)
    screenshot("requeue-refused")
    assert task_state(sql, dead) == "DEAD" and audit_rows(sql) == []
    assert executions(sql, dead) == 1

    # the schedules page shows the api's refusal too, and nothing is paused or started
    page.goto(dashboard.url("/ui/schedules"))
    row = page.locator(f'tr[data-schedule="{SCHEDULE}"]')
    expect(row.locator("[data-testid=schedule-state]")).to_have_text("active")
    for action in ("pause-schedule", "trigger-schedule"):
        with page.expect_response(
            lambda r: "/api/v1/schedules/" in r.url and r.request.method == "POST"
        ) as answer:
            row.locator(f"[data-testid={action}]").click()
        assert answer.value.status == 401, (action, answer.value.status)
        expect(flash).to_have_text("Error 401: a bearer token is required")
    screenshot("schedule-action-refused")
    assert not schedule_row(sql, SCHEDULE)[0]
    made = sql.execute("SELECT count(*) FROM workflow_runs WHERE schedule IS NOT NULL")
    assert made.fetchone() == (0,)
    expect(row.locator("[data-testid=schedule-state]")).to_have_text("active")


class ForgedSite(ThreadingHTTPServer):
    """Serves one attacker page (``html``) on another port: another origin than the api's."""

    html = b""


class _ForgedPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        assert isinstance(self.server, ForgedSite)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.server.html)))
        self.end_headers()
        self.wfile.write(self.server.html)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def forged_site() -> Iterator[ForgedSite]:
    server = ForgedSite(("127.0.0.1", 0), _ForgedPage)
    thread = threading.Thread(target=server.serve_forever, name="forged-site", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def forged_html(cancel_url: str) -> bytes:
    """Three forgeries of the cancel: a url-encoded form, a text/plain form whose body looks
    like JSON, and a no-cors fetch with a text/plain body. Forms post into an iframe so the
    page stays."""
    return f"""<!doctype html><html><body>
<iframe name="sink"></iframe>
<form id="urlencoded" method="POST" action="{cancel_url}" target="sink">
  <input name="confirm" value="yes"><button id="send-urlencoded">go</button></form>
<form id="plain" method="POST" action="{cancel_url}" target="sink" enctype="text/plain">
  <input name='{{"x": "' value='"}}'><button id="send-plain">go</button></form>
<button id="send-fetch" onclick="fetch('{cancel_url}', {{method: 'POST', mode: 'no-cors',
  credentials: 'include', headers: {{'Content-Type': 'text/plain'}}, body: '{{}}'}})">go</button>
</body></html>""".encode()


def test_forged_cross_site_requests_cancel_nothing(
    page: Page,
    dashboard: Dashboard,
    sql: Sql,
    forged_site: ForgedSite,
    screenshot: Shot,
) -> None:
    run_id = dashboard.trigger("ui-gate", {"gate": str(dashboard.gate)})
    wait_task(sql, run_id, "only", "RUNNING")
    cancel_url = dashboard.url(f"/api/v1/runs/{run_id}/cancel")
    forged_site.html = forged_html(cancel_url)
    # the operator is signed in to the dashboard in this browser
    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    save_token(page, dashboard.token)
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")

    port = forged_site.server_address[1]
    # another port on the same host (same-site), and another host name (cross-site)
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        for button in ("#send-urlencoded", "#send-plain", "#send-fetch"):
            # a fresh attacker page per forgery: two form posts into one iframe back to back
            # once left CI waiting 20 s for the second response
            page.goto(f"{origin}/")
            with page.expect_response(
                lambda r: r.url == cancel_url and r.request.method == "POST"
            ) as answer:
                page.locator(button).click()
            status = answer.value.status
            assert status in CSRF_REFUSED, (origin, button, status, answer.value.text())
            assert run_state(sql, run_id) == "RUNNING" and not cancel_requested(sql, run_id)
    screenshot("forged")

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    assert task_states(sql, run_id) == {"only": "RUNNING"}
    assert not cancel_requested(sql, run_id)


# ------------------------------------------------------------------ processes


def test_the_processes_page_lists_the_stack_processes(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    started = {process.pid: process.role for process in dashboard.processes}

    def registered() -> dict[int, str]:
        rows = sql.execute("SELECT pid, role FROM processes").fetchall()
        return {int(pid): str(role) for pid, role in rows}

    def host(pid: int) -> str:
        row = sql.execute("SELECT host FROM processes WHERE pid = %s", (pid,)).fetchone()
        assert row is not None
        return str(row[0])

    wait_for(
        lambda: started.items() <= registered().items(),
        timeout=UI_TIMEOUT_S,
        interval=0.1,
        what=f"every process of the stack to register ({started})",
    )
    in_db = registered()

    page.goto(dashboard.url("/ui/"))
    page.locator("[data-testid=nav-processes]").click()
    expect(page).to_have_url(re.compile(r"/ui/processes(?:[?#].*)?$"))
    rows = page.locator("[data-testid=processes-table] tr[data-pid]")
    expect_ids(rows, "data-pid", {str(pid) for pid in in_db})
    for pid, role in in_db.items():
        row = page.locator(f'[data-testid=processes-table] tr[data-pid="{pid}"]')
        for shown in (role, str(pid), host(pid)):
            expect(row).to_contain_text(shown)
    screenshot("processes")


def test_a_task_shows_its_queue_and_the_overview_flags_an_unserved_queue(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    run_id = dashboard.trigger("ui-elsewhere")
    try:
        wait_task(sql, run_id, "away", "READY")  # published to a queue nobody consumes
        page.goto(dashboard.url(f"/ui/runs/{run_id}"))
        dag_node(page, "away").click()
        panel = page.locator("[data-testid=task-panel]")
        expect(panel.locator("[data-testid=task-queue]")).to_have_text(UNSERVED)
        page.goto(dashboard.url("/ui/"))
        row = page.locator(f'[data-testid=queues-summary] tr[data-queue="{UNSERVED}"]')
        expect(row).to_have_class("warn")
        expect(row).to_contain_text("no live consumer")
        expect(row.locator("td").nth(1)).to_have_text("1")  # READY
        screenshot("queues")
    finally:
        with broker_channel(dashboard.stack) as channel:
            channel.queue_delete(UNSERVED)


def test_a_tasks_panel_shows_its_keys_as_text(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    """The task panel lists the task's rendered concurrency, rate and breaker keys (keys are
    rendered from run input: shown as text, never markup) and names the key it waits on."""
    dashboard.sign_in(page)
    tenant = "<i data-testid=injected-key>x</i>"
    never = str(dashboard.gate) + ".never"  # the gate stays shut: the runs are cancelled below
    first = dashboard.trigger("ui-keyed", {"tenant": tenant, "gate": never})
    second = dashboard.trigger("ui-keyed", {"tenant": tenant, "gate": never})
    try:
        wait_task(sql, first, "call", "RUNNING")
        page.goto(dashboard.url(f"/ui/runs/{second}"))
        dag_node(page, "call").click()
        panel = page.locator("[data-testid=task-panel]")
        expect(panel.locator("[data-testid=task-key]")).to_have_text(
            [
                f"concurrency t-{tenant} (limit 1)",
                f"rate_limit r-{tenant} (100 per 1s)",
                f"circuit_breaker b-{tenant}",
            ]
        )
        expect(panel.locator("[data-testid=task-waiting-on]")).to_have_text(
            f"concurrency (t-{tenant})"
        )
        expect(page.locator("[data-testid=injected-key]")).to_have_count(0)
        screenshot("task-keys")
    finally:
        for run_id in (first, second):
            status, body = dashboard.request("POST", f"/api/v1/runs/{run_id}/cancel", {})
            assert status == 200, (status, body)
        wait_run(sql, first, "CANCELLED")


# ------------------------------------------------------------------ time


def test_schedules_page_lists_pauses_resumes_and_runs_a_schedule_now(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    wait_for(
        lambda: sql.execute("SELECT 1 FROM schedules WHERE name = %s", (SCHEDULE,)).fetchone(),
        timeout=UI_TIMEOUT_S,
        interval=0.05,
        what=f"the scheduler to sync {SCHEDULE} from its workflow file",
    )
    paused, next_fire, last_run = schedule_row(sql, SCHEDULE)
    assert not paused and next_fire is not None and last_run is None
    dialogs = accept_dialogs(page)
    actions = posts_to(page, r"/api/v1/schedules/")

    page.goto(dashboard.url("/ui/"))
    page.locator("[data-testid=nav-schedules]").click()
    expect(page).to_have_url(re.compile(r"/ui/schedules(?:[?#].*)?$"))
    row = page.locator(f'[data-testid=schedules-table] tr[data-schedule="{SCHEDULE}"]')
    expect(row.locator("[data-testid=schedule-state]")).to_have_text("active")
    expect(row.locator("[data-testid=schedule-timetable]")).to_have_text("cron 0 3 1 1 *")
    expect(row).to_contain_text("Europe/Berlin")
    expect(row).to_contain_text("ui-pair")
    assert shown_instant(row.locator("[data-testid=schedule-next]")) == next_fire
    expect(row.locator("[data-testid=schedule-last-run]")).to_have_count(0)
    screenshot("listed")

    row.locator("[data-testid=pause-schedule]").click()
    wait_paused(sql, SCHEDULE, True)
    expect(row.locator("[data-testid=schedule-state]")).to_have_text("paused")
    row.locator("[data-testid=resume-schedule]").click()
    wait_paused(sql, SCHEDULE, False)
    expect(row.locator("[data-testid=schedule-state]")).to_have_text("active")
    expect(row.locator("[data-testid=pause-schedule]")).to_be_visible()

    row.locator("[data-testid=trigger-schedule]").click()
    wait_for(
        lambda: schedule_row(sql, SCHEDULE)[2] is not None,
        timeout=UI_TIMEOUT_S,
        interval=0.05,
        what="Run now to make a run",
    )
    run_id = str(schedule_row(sql, SCHEDULE)[2])
    made = run_row(sql, run_id)
    assert made["schedule"] == SCHEDULE and made["fire_time"] is not None, made
    expect(page.locator("[data-testid=flash]")).to_contain_text(f"Started run {run_id}")
    link = row.locator("[data-testid=schedule-last-run]")
    expect(link).to_have_attribute("href", f"/ui/runs/{run_id}")
    assert dialogs == ["confirm"] * 3, dialogs
    assert [r.url.rsplit("/", 1)[-1] for r in actions] == ["pause", "resume", "trigger"]
    assert all(r.url.startswith(dashboard.url("/api/v1/schedules/ui-pair%2F0/")) for r in actions)
    for sent in actions:
        assert sent.all_headers().get("authorization") == f"Bearer {dashboard.token}"

    # the schedule's decisions on demand: the manual fire, with its run
    row.locator("[data-testid=schedule-link]").click()
    panel = page.locator("[data-testid=schedule-panel]")
    expect(panel).to_have_attribute("data-schedule", SCHEDULE)
    decision = panel.locator("tr[data-testid=decision]")
    expect(decision).to_have_count(1)
    expect(decision).to_contain_text("created (run now)")
    expect(decision.locator(f'a[href="/ui/runs/{run_id}"]')).to_have_count(1)
    shown_input = panel.locator("pre[data-testid=schedule-input]")
    expect(shown_input).to_contain_text(SCHEDULE_MARKUP)  # as text: never rendered
    assert json.loads(shown_input.inner_text()) == {"from": SCHEDULE_MARKUP}
    expect(page.locator("[data-testid=injected]")).to_have_count(0)
    screenshot("run-now")

    # the run names the schedule and fire time that made it, and links back
    link.click()
    expect(page).to_have_url(re.compile(rf"/ui/runs/{run_id}$"))
    expect(page.locator("[data-testid=run-schedule]")).to_have_text(SCHEDULE)
    assert shown_instant(page.locator("[data-testid=run-fire-time]")) == made["fire_time"]
    wait_run(sql, run_id, "SUCCEEDED")
    expect(page.locator("[data-testid=run-state]")).to_have_text("SUCCEEDED")
    page.locator("[data-testid=run-schedule]").click()
    expect(page).to_have_url(re.compile(r"/ui/schedules\?schedule=ui-pair%2F0$"))
    expect(page.locator("[data-testid=schedule-panel]")).to_have_attribute(
        "data-schedule", SCHEDULE
    )

    # a link to a schedule that does not exist says so once and keeps the list
    page.goto(dashboard.url("/ui/schedules?schedule=nope%2F9"))
    expect(page.locator("[data-testid=flash]")).to_have_text(
        "Error 404: no schedule named 'nope/9'"
    )
    expect(page.locator("[data-testid=schedule-panel]")).to_be_hidden()
    expect(page.locator(f'tr[data-schedule="{SCHEDULE}"]')).to_be_visible()
    expect(page).to_have_url(re.compile(r"/ui/schedules$"))

    # and so does the runs list
    page.goto(dashboard.url("/ui/runs"))
    listed = page.locator(f'tr[data-run-id="{run_id}"]')
    expect(listed.locator("[data-testid=run-schedule]")).to_have_text(SCHEDULE)
    assert shown_instant(listed.locator("[data-testid=run-fire-time]")) == made["fire_time"]


def test_a_delayed_run_shows_scheduled_with_its_start_and_is_cancelled_from_its_page(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    delayed = dashboard.trigger("ui-pair", delay="1h", deadline="2h")
    now = dashboard.trigger("ui-pair")
    sleeper = dashboard.trigger("ui-timer")
    wait_run(sql, now, "SUCCEEDED")
    stored = run_row(sql, delayed)
    assert stored["state"] == "SCHEDULED" and stored["start_at"] is not None, stored
    nap = wait_task(sql, sleeper, "nap", "RUNNING")
    row = sql.execute("SELECT wake_at FROM task_runs WHERE id = %s", (nap,)).fetchone()
    assert row is not None and row[0] is not None
    wake_at: datetime = row[0]

    page.goto(dashboard.url("/ui/runs"))
    page.locator("select[name=state]").select_option("SCHEDULED")
    page.locator("[data-testid=apply-filters]").click()
    rows = page.locator("[data-testid=runs-table] tr[data-run-id]")
    expect_ids(rows, "data-run-id", {delayed})
    listed = page.locator(f'tr[data-run-id="{delayed}"]')
    expect(listed.locator("[data-testid=run-state]")).to_have_text("SCHEDULED")
    assert shown_instant(listed.locator("[data-testid=run-start-at]")) == stored["start_at"]
    assert shown_instant(listed.locator("[data-testid=run-deadline]")) == stored["deadline_at"]
    screenshot("scheduled-listed")

    # a sleeping timer shows when it wakes
    page.goto(dashboard.url(f"/ui/runs/{sleeper}"))
    expect(dag_node(page, "nap")).to_have_attribute("data-state", "RUNNING")
    dag_node(page, "nap").click()
    panel = page.locator("[data-testid=task-panel]")
    expect(panel).to_have_attribute("data-task", "nap")
    assert shown_instant(panel.locator("[data-testid=task-wake]")) == wake_at
    expect(panel).to_contain_text("durable timer: sleeps 1h")

    dialogs = accept_dialogs(page)
    page.goto(dashboard.url(f"/ui/runs/{delayed}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("SCHEDULED")
    assert shown_instant(page.locator("[data-testid=run-start-at]")) == stored["start_at"]
    assert shown_instant(page.locator("[data-testid=run-deadline]")) == stored["deadline_at"]
    screenshot("scheduled")
    page.locator("[data-testid=cancel-run]").click()
    expect(page.locator("[data-testid=run-state]")).to_have_text("CANCELLED")
    assert dialogs == ["confirm"], dialogs
    wait_run(sql, delayed, "CANCELLED")
    assert set(task_states(sql, delayed).values()) == {"CANCELLED"}
    ran = sql.execute("SELECT count(*) FROM test_executions WHERE run_id = %s", (delayed,))
    assert ran.fetchone() == (0,), "a task of the cancelled delayed run executed"
    expect(page.locator("[data-testid=cancel-run]")).to_be_hidden()


def test_a_run_past_its_deadline_shows_deadline_exceeded(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    run_id = dashboard.trigger("ui-mixed", {"gate": str(dashboard.gate)}, deadline=2)
    wait_run(sql, run_id, "FAILED")
    stored = run_row(sql, run_id)
    assert stored["failure_reason"] == "deadline_exceeded", stored

    page.goto(dashboard.url("/ui/runs?state=FAILED"))
    listed = page.locator(f'tr[data-run-id="{run_id}"]')
    expect(listed.locator("[data-testid=run-state]")).to_have_text("FAILED")
    expect(listed.locator("[data-testid=run-reason]")).to_have_text("deadline_exceeded")
    assert shown_instant(listed.locator("[data-testid=run-deadline]")) == stored["deadline_at"]

    listed.locator("a[data-testid=run-link]").click()
    expect(page.locator("[data-testid=run-state]")).to_have_text("FAILED")
    expect(page.locator("[data-testid=run-reason]")).to_have_text("deadline_exceeded")
    assert shown_instant(page.locator("[data-testid=run-deadline]")) == stored["deadline_at"]
    expect(page.locator("[data-testid=run-schedule]")).to_have_count(0)
    # the gate was asked to stop (its handler returns when it sees ctx.cancelled); the task
    # after it never started
    states = expect_dag_matches(page, sql, run_id)
    assert states["first"] == "SUCCEEDED" and states["last"] == "CANCELLED", states
    expect(page.locator("[data-testid=cancel-run]")).to_be_hidden()
    screenshot("deadline-exceeded")


# ------------------------------------------------------------------ a map's items

ITEMS_PAGE = 50  # flowforge/dashboard/static/run.js


def item_rows(page: Page) -> Locator:
    return page.locator("[data-testid=task-panel] [data-testid=items-table] tr[data-testid=item]")


def expect_item_indexes(page: Page, expected: list[int]) -> None:
    """Poll until the items table shows exactly ``expected``, in that order."""

    def shown() -> list[int]:
        values = item_rows(page).evaluate_all("rows => rows.map(r => r.dataset.index)")
        return [int(v) for v in values]

    wait_for(
        lambda: shown() == expected,
        timeout=UI_TIMEOUT_S,
        interval=0.1,
        what=f"items {expected[:3]}...{expected[-3:]} (shown: {shown()})",
    )


def item_states(sql: Sql, map_id: str) -> dict[int, str]:
    rows = sql.execute("SELECT item_index, state FROM task_runs WHERE map_id = %s", (map_id,))
    return {int(index): str(state) for index, state in rows.fetchall()}


def test_a_map_node_opens_its_items_page_by_page_with_counts_and_a_state_filter(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    failing = [3, 64]
    markup = "<b data-testid=injected>item</b>"
    run_id = dashboard.trigger("ui-map", {"n": 120, "fail": failing, "label": markup, "item_s": 0})
    wait_run(sql, run_id, "FAILED")
    map_id = task_id(sql, run_id, "process")
    stored = item_states(sql, map_id)
    assert len(stored) == 120 and {i for i, s in stored.items() if s == "DEAD"} == set(failing)
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/items" in r.url else None)

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    expect(dag_node(page, "process")).to_have_attribute("data-state", "DEAD")
    dag_node(page, "list").click()
    panel = page.locator("[data-testid=task-panel]")
    expect(panel).to_have_attribute("data-task", "list")
    expect(panel.locator("[data-testid=map-items]")).to_be_hidden()  # not a map

    dag_node(page, "process").click()
    expect(panel).to_have_attribute("data-task", "process")
    items = panel.locator("[data-testid=map-items]")
    expect(items).to_be_visible()
    expect(items.locator("[data-testid=item-count-SUCCEEDED]")).to_have_text("118")
    expect(items.locator("[data-testid=item-count-DEAD]")).to_have_text("2")
    expect(items.locator("[data-testid=items-summary]")).to_contain_text("120 items")
    expect_item_indexes(page, list(range(50)))
    expect(items.locator("[data-testid=items-page]")).to_have_text("page 1")
    expect(items.locator("[data-testid=items-prev]")).to_be_disabled()
    shown = {
        int(i): str(s)
        for i, s in item_rows(page).evaluate_all(
            "rows => rows.map(r => [r.dataset.index, r.dataset.state])"
        )
    }
    assert shown == {i: stored[i] for i in range(50)}
    dead = page.locator('tr[data-testid=item][data-index="3"]')
    expect(dead.locator("[data-testid=item-state]")).to_have_text("DEAD")
    expect(dead.locator("[data-testid=item-reason]")).to_have_text("permanent_error")
    expect(dead.locator("td").nth(3)).to_have_text("1")  # attempts
    expect(dead.locator("td.item")).to_contain_text(markup)  # shown as text...
    expect(page.locator("[data-testid=injected]")).to_have_count(0)  # ...never rendered
    screenshot("map-items")

    next_page = items.locator("[data-testid=items-next]")
    next_page.click()
    expect_item_indexes(page, list(range(50, 100)))
    expect(items.locator("[data-testid=items-page]")).to_have_text("page 2")
    expect(page.locator('tr[data-testid=item][data-index="64"]')).to_have_attribute(
        "data-state", "DEAD"
    )
    next_page.click()
    expect_item_indexes(page, list(range(100, 120)))
    expect(next_page).to_be_disabled()  # the last page
    items.locator("[data-testid=items-prev]").click()
    expect_item_indexes(page, list(range(50, 100)))
    expect(items.locator("[data-testid=items-page]")).to_have_text("page 2")

    # a filter starts from its first page
    items.locator("[data-testid=item-state-filter]").select_option("DEAD")
    expect_item_indexes(page, failing)
    expect(items.locator("[data-testid=items-page]")).to_have_text("page 1")
    expect(next_page).to_be_disabled()
    expect(items.locator("[data-testid=item-count-SUCCEEDED]")).to_have_text("118")
    items.locator("[data-testid=item-state-filter]").select_option("SUCCEEDED")
    succeeded = [i for i in range(120) if i not in failing]
    expect_item_indexes(page, succeeded[:50])
    next_page.click()
    expect_item_indexes(page, succeeded[50:100])
    items.locator("[data-testid=item-state-filter]").select_option("RUNNING")
    expect(items.locator("tr.empty")).to_have_text("no RUNNING item")
    screenshot("map-items-filtered")

    # a page at a time: never the whole map
    assert asked, "the panel read no items"
    for url in asked:
        assert f"limit={ITEMS_PAGE}" in url, url


def test_a_run_links_to_its_child_run_and_the_child_back(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    parent = dashboard.trigger("ui-parent", {"gate": str(dashboard.gate)})
    call = wait_task(sql, parent, "call", "RUNNING")
    row = sql.execute("SELECT child_run_id FROM task_runs WHERE id = %s", (call,)).fetchone()
    assert row is not None and row[0] is not None
    child = str(row[0])
    wait_task(sql, child, "only", "RUNNING")

    page.goto(dashboard.url(f"/ui/runs/{parent}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("RUNNING")
    link = page.locator("a[data-testid=run-child]")
    expect(link).to_have_count(1)
    expect(link).to_have_attribute("data-task", "call")
    expect(link).to_contain_text("attempt 1, ui-gate")
    expect(page.locator("a[data-testid=run-parent]")).to_have_count(0)
    dag_node(page, "call").click()
    expect(page.locator("a[data-testid=task-child]")).to_have_text(child)
    screenshot("parent")

    link.click()
    expect(page).to_have_url(re.compile(rf"/ui/runs/{child}(?:[/?#].*)?$"))
    expect(page.locator("#run-workflow")).to_have_text("ui-gate")
    back = page.locator("a[data-testid=run-parent]")
    expect(back).to_have_text(parent)
    expect(page.locator("a[data-testid=run-child]")).to_have_count(0)
    screenshot("child")
    back.click()
    expect(page).to_have_url(re.compile(rf"/ui/runs/{parent}(?:[/?#].*)?$"))


def test_bury_a_running_task_from_its_panel_with_a_reason(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    """The task panel's Bury asks for a reason, the running handler is stopped (it never
    finishes its gate), the task is DEAD ``operator``, what it fed CANCELLED, the run FAILED;
    the panel lists the audited action and offers no more actions on a finished task."""
    run_id = dashboard.trigger("ui-mixed", {"gate": str(dashboard.gate)})
    tid = wait_task(sql, run_id, "gated", "RUNNING")
    reason = f"stuck on a partner ({uuid.uuid4().hex[:8]})"
    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    save_token(page, dashboard.token)
    dag_node(page, "gated").click()
    panel = page.locator("[data-testid=task-panel]")
    expect(panel.locator("[data-testid=task-state]")).to_have_text("RUNNING")
    expect(panel.locator("[data-testid=task-retry-now]")).to_be_hidden()
    prompts: list[str] = []

    def answer(dialog: Dialog) -> None:
        prompts.append(dialog.type)
        dialog.accept(reason)

    page.on("dialog", answer)
    buries = posts_to(page, rf"/api/v1/task-runs/{tid}/bury$")
    panel.locator("[data-testid=task-bury]").click()

    wait_task(sql, run_id, "gated", "DEAD")
    wait_run(sql, run_id, "FAILED")
    expect(panel.locator("[data-testid=task-state]")).to_have_text("DEAD")
    expect(panel.locator("[data-testid=audit-entry]")).to_contain_text(reason)
    expect(panel.locator("[data-testid=task-bury]")).to_be_hidden()
    expect(panel.locator("[data-testid=task-cancel]")).to_be_hidden()
    screenshot("task-buried")
    assert prompts == ["prompt"] and len(buries) == 1
    assert task_states(sql, run_id) == {"first": "SUCCEEDED", "gated": "DEAD", "last": "CANCELLED"}
    row = sql.execute(
        "SELECT t.failure_reason, a.requested_by, a.reason, a.previous_state"
        " FROM task_runs t JOIN task_audit a ON a.task_run_id = t.id WHERE t.id = %s",
        (tid,),
    ).fetchall()
    assert row == [("operator", "dashboard", reason, "RUNNING")]
    # one execution, stopped at its gate (which never opened): nothing ran it again
    assert executions(sql, tid) == 1


def test_a_running_task_shows_its_progress_and_output_as_text(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    """The task panel shows the running attempt's progress and its output (ctx.log, stdout,
    stderr) as they are written, refreshed live; the handler's markup is text, never HTML."""
    markup = "<b data-testid=injected>bold</b>"
    run_id = dashboard.trigger(
        "ui-talk", {"gate": str(dashboard.gate), "text": markup, "progress": 0.4}
    )
    wait_task(sql, run_id, "only", "RUNNING")
    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    save_token(page, dashboard.token)
    dag_node(page, "only").click()
    panel = page.locator("[data-testid=task-panel]")
    expect(panel.locator("[data-testid=task-progress]")).to_have_text(f"40% {markup}")
    output = panel.locator("[data-testid=task-output]")
    expect(output).to_contain_text(f"INFO log {markup}")
    expect(output).to_contain_text(f"out {markup}")
    expect(output).to_contain_text(f"err {markup}")
    expect(panel.locator("[data-testid=output-of]")).to_have_text("(attempt 1, running)")
    assert page.locator("[data-testid=injected]").count() == 0
    screenshot("task-output")
    dashboard.gate.touch()
    wait_task(sql, run_id, "only", "SUCCEEDED")
    expect(panel.locator("[data-testid=output-of]")).to_have_text("(attempt 1)")
    expect(output).to_contain_text(f"INFO log {markup}")
