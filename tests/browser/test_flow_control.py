"""The dashboard's Flow control page (/ui/flow): circuit breakers and pauses shown and controlled
in a real browser against a live stack (docs/flow-control.md "Circuit breakers and pauses").
Each action asks for a reason (a prompt), is audited as ``dashboard``, and the tasks it holds
are parked, then run once when it is lifted — counted in the database."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Dialog, Page, expect

from tests.browser.conftest import Dashboard
from tests.browser.test_dashboard import (
    Shot,
    executions,
    posts_to,
    save_token,
    task_id,
    wait_run,
)
from tests.helpers import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow]

Sql = psycopg.Connection[tuple[Any, ...]]


def answer_prompts(page: Page, reason: str) -> list[str]:
    """Answer every prompt with ``reason``; the dialog types seen, live."""
    seen: list[str] = []

    def answer(dialog: Dialog) -> None:
        seen.append(dialog.type)
        dialog.accept(reason)

    page.on("dialog", answer)
    return seen


def parked(sql: Sql, run_id: str) -> str | None:
    row = sql.execute(
        "SELECT parked_on FROM task_runs WHERE run_id = %s AND name = 'first'", (run_id,)
    ).fetchone()
    return None if row is None else row[0]


def test_hold_a_breaker_open_and_close_it_from_the_flow_page(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    wait_run(sql, dashboard.trigger("ui-pair"), "SUCCEEDED")  # e2e.record is a known handler
    reason = f"partner maintenance ({uuid.uuid4().hex[:8]})"
    prompts = answer_prompts(page, reason)
    page.goto(dashboard.url("/ui/flow"))
    save_token(page, dashboard.token)
    expect(page.locator("#breakers-empty")).to_be_visible()
    opens = posts_to(page, r"/api/v1/breakers/e2e\.record/open$")
    page.locator("[data-testid=open-breaker-handler]").fill("e2e.record")
    page.locator("[data-testid=open-breaker]").click()
    row = page.locator("[data-testid=breakers-table] tbody tr[data-handler='e2e.record']")
    expect(row.locator("[data-testid=breaker-state]")).to_have_text("open (held)")
    run_id = dashboard.trigger("ui-pair")
    wait_for(lambda: parked(sql, run_id) == "circuit_open", 60.0, 0.05, "the task parked")
    expect(row.locator("[data-testid=breaker-parked]")).to_have_text("1")
    screenshot("breaker-held-open")
    row.locator("[data-testid=close-breaker]").click()
    wait_run(sql, run_id, "SUCCEEDED")
    expect(row.locator("[data-testid=breaker-state]")).to_have_text("closed")
    assert executions(sql, task_id(sql, run_id, "first")) == 1
    assert prompts == ["prompt", "prompt"] and len(opens) == 1
    audit = sql.execute(
        "SELECT action, requested_by, reason FROM gate_audit ORDER BY id"
    ).fetchall()
    assert audit == [
        ("breaker_open", "dashboard", reason),
        ("breaker_close", "dashboard", reason),
    ]


def test_a_keyed_breaker_is_listed_and_its_buttons_act_on_its_key_only(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    wait_run(sql, dashboard.trigger("ui-pair"), "SUCCEEDED")  # e2e.record is a known handler
    prompts = answer_prompts(page, "region down")
    page.goto(dashboard.url("/ui/flow"))
    save_token(page, dashboard.token)
    expect(page.locator("#breakers-empty")).to_be_visible()
    keyed_opens = posts_to(page, r"/api/v1/breakers/e2e\.record/open\?key=partner-eu$")
    page.locator("[data-testid=open-breaker-handler]").fill("e2e.record")
    page.locator("[data-testid=open-breaker-key]").fill("partner-eu")
    page.locator("[data-testid=open-breaker]").click()
    rows = "[data-testid=breakers-table] tbody tr[data-handler='e2e.record']"
    keyed = page.locator(f"{rows}[data-breaker-key='partner-eu']")
    expect(keyed.locator("[data-testid=breaker-key]")).to_have_text("partner-eu")
    expect(keyed.locator("[data-testid=breaker-state]")).to_have_text("open (held)")
    page.locator("[data-testid=open-breaker-key]").fill("")
    page.locator("[data-testid=open-breaker]").click()  # the handler's own breaker
    own = page.locator(f"{rows}[data-breaker-key='']")
    expect(own.locator("[data-testid=breaker-state]")).to_have_text("open (held)")
    screenshot("keyed-breaker")
    closes = posts_to(page, r"/api/v1/breakers/e2e\.record/close\?key=partner-eu$")
    keyed.locator("[data-testid=close-breaker]").click()
    expect(keyed.locator("[data-testid=breaker-state]")).to_have_text("closed")
    expect(own.locator("[data-testid=breaker-state]")).to_have_text("open (held)")
    assert prompts == ["prompt"] * 3 and len(keyed_opens) == 1 and len(closes) == 1
    audit = sql.execute("SELECT action, key FROM gate_audit ORDER BY id").fetchall()
    assert audit == [
        ("breaker_open", "partner-eu"),
        ("breaker_open", None),
        ("breaker_close", "partner-eu"),
    ]


def test_pause_a_queue_and_resume_it_from_the_flow_page(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    queue = dashboard.stack.queue
    answer_prompts(page, "deploying")
    page.goto(dashboard.url("/ui/flow"))
    save_token(page, dashboard.token)
    page.locator("[data-testid=pause-scope]").select_option("queue")
    page.locator("[data-testid=pause-name]").fill(queue)
    page.locator("[data-testid=pause]").click()
    row = page.locator(f"[data-testid=pauses-table] tbody tr[data-name='{queue}']")
    expect(row).to_be_visible()
    run_id = dashboard.trigger("ui-pair")
    wait_for(lambda: parked(sql, run_id) == "paused", 60.0, 0.05, "the task parked")
    expect(row.locator("[data-testid=pause-parked]")).to_have_text("1")
    assert executions(sql, task_id(sql, run_id, "first")) == 0
    screenshot("queue-paused")
    row.locator("[data-testid=resume]").click()
    wait_run(sql, run_id, "SUCCEEDED")
    expect(page.locator("#pauses-empty")).to_be_visible()
    assert executions(sql, task_id(sql, run_id, "first")) == 1
    actions = sql.execute("SELECT action, name FROM gate_audit ORDER BY id").fetchall()
    assert actions == [("pause", queue), ("resume", queue)]
