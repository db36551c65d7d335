"""The run page's timeline in Chromium against a live stack (docs/dashboard-contract.md
"Timeline").

Proven here, every count read from the database: one row per task and per shown item of the
map, one row counting the map's other items; one bar per attempt of each task and item, its
outcome the database's; the retry's backoff visible between the failed attempts and the next;
hovering or focusing an attempt shows its times, outcome and the first line of its error as
text (markup in it never becomes an element, nor runs); a task's row opens its panel; a running
attempt's bar is open and grows with the page's refresh.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from playwright.sync_api import Dialog, Locator, Page, expect

from tests.browser.conftest import Dashboard
from tests.browser.test_dashboard import (
    RUN_TIMEOUT_S,
    UI_TIMEOUT_S,
    Shot,
    Sql,
    task_id,
    wait_run,
    wait_task,
)
from tests.helpers import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow]

#: Items of the map: the timeline shows the first 20 (TimelineLimits.items) and counts the rest.
ITEMS = 23
SHOWN_ITEMS = 20
#: In the name of the file flaky waits for, so in its error: markup that must stay text.
MARKUP = "<img src=x onerror=alert(1)>"


def rows(page: Page, kind: str) -> Locator:
    return page.locator(f"svg[data-testid=timeline] g[data-testid=timeline-row][data-kind={kind}]")


def row(page: Page, name: str) -> Locator:
    return page.locator(
        f'svg[data-testid=timeline] g[data-testid=timeline-row][data-task="{name}"]'
    )


def attempts_by_task(sql: Sql, run_id: str) -> dict[str, list[str]]:
    """Each task's and item's attempt outcomes, in attempt order (tasks without one absent)."""
    found = sql.execute(
        "SELECT t.name, array_agg(a.outcome ORDER BY a.attempt) FROM task_attempts a"
        " JOIN task_runs t ON t.id = a.task_run_id WHERE t.run_id = %s GROUP BY t.name",
        (run_id,),
    ).fetchall()
    return {str(name): list(outcomes) for name, outcomes in found}


def failed_attempts(sql: Sql, task_run_id: str) -> int:
    found = sql.execute(
        "SELECT count(*) FROM task_attempts WHERE task_run_id = %s AND outcome = 'failed'",
        (task_run_id,),
    ).fetchone()
    assert found is not None
    return int(found[0])


def drawn_attempts(page: Page) -> dict[str, list[str]]:
    """Each drawn row's attempt bars' outcomes, in attempt order (rows without one absent)."""
    found: dict[str, list[str]] = page.locator(
        "svg[data-testid=timeline] g[data-testid=timeline-row]"
    ).evaluate_all(
        """rows => Object.fromEntries(rows
             .map(r => [r.dataset.task, [...r.querySelectorAll('[data-kind=attempt]')]
               .sort((a, b) => a.dataset.attempt - b.dataset.attempt)
               .map(s => s.dataset.outcome)])
             .filter(([name, outcomes]) => name && outcomes.length))"""
    )
    return found


def box(locator: Locator) -> dict[str, float]:
    found = locator.bounding_box()
    assert found is not None
    return dict(found)


def test_the_timeline_shows_every_task_and_attempt_the_retry_and_its_error_as_text(
    page: Page, dashboard: Dashboard, sql: Sql, tmp_path: Path, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    dialogs: list[Dialog] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog))
    fixed = tmp_path / MARKUP
    run_id = dashboard.trigger("ui-timeline", {"file": str(fixed), "n": ITEMS, "item_s": 0})
    flaky = task_id(sql, run_id, "flaky")
    wait_for(
        lambda: failed_attempts(sql, flaky) >= 2,
        timeout=RUN_TIMEOUT_S,
        interval=0.05,
        what="flaky's second failure",
    )
    fixed.touch()  # its next attempt succeeds
    wait_run(sql, run_id, "SUCCEEDED")
    stored = attempts_by_task(sql, run_id)
    assert stored["flaky"][:2] == ["failed", "failed"] and stored["flaky"][-1] == "succeeded"
    assert len(stored) == 3 + ITEMS  # flaky, list, merge and every item (the map has none)

    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    expect(page.locator("[data-testid=run-state]")).to_have_text("SUCCEEDED")
    tasks = rows(page, "task")
    expect(tasks).to_have_count(4)
    names = tasks.evaluate_all("rows => rows.map(r => r.dataset.task)")
    assert names == ["flaky", "list", "process", "merge"]
    expect(rows(page, "item")).to_have_count(SHOWN_ITEMS)
    more = rows(page, "more")
    expect(more).to_have_count(1)
    expect(more).to_contain_text(f"+ {ITEMS - SHOWN_ITEMS} more items")
    expect(more).to_have_attribute("data-map", "process")
    expect(more.locator("[data-testid=timeline-segment][data-kind=items]")).to_have_count(1)

    # a bar per attempt of every task and shown item, with the database's outcome
    shown_names = {"flaky", "list", "merge", *(f"process[{i}]" for i in range(SHOWN_ITEMS))}
    assert drawn_attempts(page) == {n: o for n, o in stored.items() if n in shown_names}
    expect(row(page, "process")).to_have_count(1)  # the map's row; its rest names it apart
    expect(row(page, "process").locator("[data-kind=span]")).to_have_count(1)

    # the retries: a backoff between each failed attempt and the next, visibly wide
    flaky_row = row(page, "flaky")
    bars = flaky_row.locator("[data-testid=timeline-segment][data-kind=attempt]")
    expect(bars).to_have_count(len(stored["flaky"]))
    backoffs = flaky_row.locator("[data-testid=timeline-segment][data-kind=backoff]")
    expect(backoffs).to_have_count(len(stored["flaky"]) - 1)
    starts = bars.evaluate_all("bars => bars.map(b => [b.dataset.start, b.dataset.end])")
    times = sql.execute(
        "SELECT started_at, finished_at FROM task_attempts WHERE task_run_id = %s ORDER BY attempt",
        (flaky,),
    ).fetchall()
    assert [tuple(datetime.fromisoformat(t) for t in pair) for pair in starts] == times
    first, second = box(bars.nth(0)), box(bars.nth(1))
    assert second["x"] - (first["x"] + first["width"]) > 5  # ~1 s of a few seconds' axis
    assert box(backoffs.nth(0))["width"] > 5

    # focus (keyboard) and hover show an attempt's details as text
    tip = page.locator("[data-testid=timeline-tip]")
    bars.nth(0).focus()
    expect(tip).to_contain_text("flaky: attempt 1 failed (handler_error)")
    expect(tip).to_contain_text(f"{MARKUP} does not exist yet")
    expect(page.locator("img")).to_have_count(0)  # the markup stayed text
    screenshot("focused-failed-attempt")
    bars.nth(len(stored["flaky"]) - 1).hover()
    expect(tip).to_contain_text(f"attempt {len(stored['flaky'])} succeeded")
    backoffs.nth(0).hover()
    expect(tip).to_contain_text("flaky: backoff before its next attempt")
    assert dialogs == []  # nothing ran

    # a task's row opens its panel
    flaky_row.locator(".tl-label").click()
    expect(page.locator("[data-testid=task-panel]")).to_have_attribute("data-task", "flaky")


def test_a_running_attempt_grows_with_the_refresh(
    page: Page, dashboard: Dashboard, sql: Sql, screenshot: Shot
) -> None:
    dashboard.sign_in(page)
    run_id = dashboard.trigger("ui-gate", {"gate": str(dashboard.gate)})
    only = wait_task(sql, run_id, "only", "RUNNING")
    started = sql.execute(
        "SELECT started_at FROM task_attempts WHERE task_run_id = %s AND attempt = 1", (only,)
    ).fetchone()
    assert started is not None
    page.goto(dashboard.url(f"/ui/runs/{run_id}"))
    bar = row(page, "only").locator("[data-testid=timeline-segment][data-kind=attempt]")
    expect(bar).to_have_attribute("data-open", "true")
    expect(bar).to_have_attribute("data-outcome", "running")
    assert datetime.fromisoformat(bar.get_attribute("data-start") or "") == started[0]
    ends: list[datetime] = []

    def grown() -> bool:
        ends.append(datetime.fromisoformat(bar.get_attribute("data-end") or ""))
        return ends[-1] > ends[0]  # a later refresh: it ends at a later now

    wait_for(grown, timeout=UI_TIMEOUT_S, interval=0.25, what=f"the bar to grow ({ends})")
    assert ends[0] > started[0]
    screenshot("running")
