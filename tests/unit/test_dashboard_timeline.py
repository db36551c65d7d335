"""The run page's timeline layout (flowforge/dashboard/timeline.py) and the read model's bounds
(flowforge/domain/timeline.py) — pure, no database.

Proven here: a worker task's row is its wait, its attempts and the backoffs between them; a
task waiting for its retry, a running attempt and a task waiting to start grow to now; a task
still waiting for its dependencies has no segment; attempts left out are counted and hide the
first wait; a task no worker runs is a wait and one span; a map is followed by its shown items
and one row for the rest (after the map itself when none is shown), tasks left out are one
last row; the axis spans the run, at least one second, with round ticks; an error shows its
first line, cut; limits below 1 are refused; for any history, segments are ordered, never
overlap and stay on the axis.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.dashboard.timeline import (
    LABEL_WIDTH,
    Layout,
    Row,
    duration_label,
    first_line,
    lay_out,
    ticks,
)
from flowforge.domain.model import Attempt, Run
from flowforge.domain.states import RunState
from flowforge.domain.timeline import (
    MapRest,
    TimelineFacts,
    TimelineLimits,
    TimelineTask,
    shown_items,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(finished: float | None = None) -> Run:
    return Run(
        id=uuid.uuid4(),
        workflow="wf",
        state=RunState.SUCCEEDED if finished is not None else RunState.RUNNING,
        input={},
        idempotency_key=None,
        cancel_requested=False,
        created_at=T0,
        started_at=at(1),
        finished_at=None if finished is None else at(finished),
    )


def attempt(
    n: int, start: float, end: float | None, outcome: str, error: str | None = None
) -> Attempt:
    return Attempt(
        task_run_id=uuid.uuid4(),
        attempt=n,
        fencing_token=n,
        worker=f"w-{n}",
        started_at=at(start),
        finished_at=None if end is None else at(end),
        outcome=outcome,
        failure_reason=None if outcome in ("succeeded", "running") else "handler_error",
        error=error,
        traceback=None,
    )


def task(name: str = "t", **changes: Any) -> TimelineTask:
    base = TimelineTask(
        id=uuid.uuid4(),
        name=name,
        handler="h.x",
        kind="worker",
        state="SUCCEEDED",
        attempt=0,
        created_at=T0,
        eligible_at=T0,
        started_at=None,
        finished_at=None,
        retry_at=None,
        failure_reason=None,
        map_id=None,
        item_index=None,
    )
    attempts = changes.get("attempts", ())
    return replace(base, attempt=len(attempts), **changes)


def facts(
    *tasks: TimelineTask, now: float = 100, finished: float | None = None, **more: Any
) -> TimelineFacts:
    top = [t for t in tasks if t.map_id is None]
    return TimelineFacts(
        run=run(finished),
        now=at(now),
        tasks=tasks,
        tasks_total=more.pop("tasks_total", len(top)),
        rests=more.pop("rests", ()),
        limits=more.pop("limits", TimelineLimits()),
    )


def kinds(row: Row) -> list[tuple[str, float, float, bool]]:
    return [(s.kind, s.start_s, s.end_s, s.open) for s in row.segments]


def only(layout: Layout) -> Row:
    (row,) = layout.rows
    return row


# ------------------------------------------------------------------ a worker task's row


def test_a_retried_task_is_its_wait_its_attempts_and_the_backoff_between() -> None:
    attempts = (attempt(1, 2, 5, "failed", "boom\ntrace"), attempt(2, 9, 12, "succeeded"))
    row = only(lay_out(facts(task(attempts=attempts, finished_at=at(12)), finished=13)))
    assert kinds(row) == [
        ("wait", 0, 2, False),
        ("attempt", 2, 5, False),
        ("backoff", 5, 9, False),
        ("attempt", 9, 12, False),
    ]
    one, two = row.segments[1], row.segments[3]
    assert (one.attempt, one.outcome, one.failure_reason, one.worker) == (
        1,
        "failed",
        "handler_error",
        "w-1",
    )
    assert one.error == "boom" and two.error is None
    assert (row.attempts, row.attempts_omitted, row.kind, row.depth) == (2, 0, "task", 0)


def test_attempts_back_to_back_have_no_backoff_and_no_wait_when_started_at_once() -> None:
    attempts = (attempt(1, 0, 5, "lease_expired"), attempt(2, 5, 6, "succeeded"))
    row = only(lay_out(facts(task(attempts=attempts, finished_at=at(6)), finished=6)))
    assert [s.kind for s in row.segments] == ["attempt", "attempt"]


def test_a_task_waiting_for_its_retry_has_an_open_backoff_to_now() -> None:
    waiting = task(state="RETRYING", attempts=(attempt(1, 2, 5, "failed"),), retry_at=at(160))
    row = only(lay_out(facts(waiting, now=50)))
    assert kinds(row)[-1] == ("backoff", 5, 50, True)
    assert row.retry_at == at(160)
    assert only(lay_out(facts(replace(waiting, state="DEAD"), now=50))).retry_at is None


def test_a_running_attempt_ends_at_now_and_grows_on_the_next_read() -> None:
    running = task(state="RUNNING", attempts=(attempt(1, 2, None, "running"),))
    first = only(lay_out(facts(running, now=10)))
    later = only(lay_out(facts(running, now=30)))
    assert kinds(first)[-1] == ("attempt", 2, 10, True)
    assert kinds(later)[-1] == ("attempt", 2, 30, True)
    assert first.segments[-1].end == at(10)


def test_a_task_waiting_to_start_has_an_open_wait_and_one_waiting_on_dependencies_none() -> None:
    ready = task(state="READY", eligible_at=at(4))
    assert kinds(only(lay_out(facts(ready, now=20)))) == [("wait", 4, 20, True)]
    pending = task(state="PENDING", eligible_at=None)
    assert only(lay_out(facts(pending, now=20))).segments == ()


def test_a_task_cancelled_before_it_started_waited_until_it_was_cancelled() -> None:
    cancelled = task(state="CANCELLED", eligible_at=at(2), finished_at=at(7))
    assert kinds(only(lay_out(facts(cancelled)))) == [("wait", 2, 7, False)]
    never = task(state="CANCELLED", eligible_at=None, finished_at=at(7))
    assert only(lay_out(facts(never))).segments == ()


def test_attempts_left_out_are_counted_and_hide_the_first_wait() -> None:
    attempts = (attempt(3, 20, 22, "failed"), attempt(4, 30, 31, "succeeded"))
    row = only(lay_out(facts(replace(task(attempts=attempts), attempt=4), finished=40)))
    assert (row.attempts, row.attempts_omitted) == (4, 2)
    assert [s.kind for s in row.segments] == ["attempt", "backoff", "attempt"]


def test_a_wait_that_ends_before_it_starts_is_not_drawn() -> None:
    # a rerun: the dependencies finished again after the task's first attempt
    rerun = task(attempts=(attempt(1, 2, 3, "succeeded"),), eligible_at=at(50))
    assert [s.kind for s in only(lay_out(facts(rerun))).segments] == ["attempt"]


def test_an_open_segment_never_ends_before_it_starts() -> None:
    skewed = task(state="RUNNING", attempts=(attempt(1, 12, None, "running"),))
    segment = only(lay_out(facts(skewed, now=10))).segments[-1]
    assert segment.end == segment.start and segment.open


# ------------------------------------------------------------------ tasks no worker runs


@pytest.mark.parametrize("kind", ["timer", "map", "event", "child"])
def test_a_task_no_worker_runs_is_its_wait_and_one_span(kind: str) -> None:
    done = task(kind=kind, eligible_at=at(1), started_at=at(3), finished_at=at(9))
    assert kinds(only(lay_out(facts(done, finished=9)))) == [
        ("wait", 1, 3, False),
        ("span", 3, 9, False),
    ]
    going = replace(done, state="RUNNING", finished_at=None)
    assert kinds(only(lay_out(facts(going, now=20)))) == [
        ("wait", 1, 3, False),
        ("span", 3, 20, True),
    ]
    waiting = replace(going, state="PENDING", started_at=None)
    assert kinds(only(lay_out(facts(waiting, now=20)))) == [("wait", 1, 20, True)]


# ------------------------------------------------------------------ maps and bounds


def a_map(name: str = "process", items: int = 2) -> list[TimelineTask]:
    mapped = task(name, kind="map", state="RUNNING", started_at=at(3))
    return [mapped] + [
        task(f"{name}[{i}]", map_id=mapped.id, item_index=i, eligible_at=at(3))
        for i in range(items)
    ]


def rest(map_id: uuid.UUID, **changes: Any) -> MapRest:
    base = MapRest(
        map_id=map_id,
        n=9_998,
        counts={"SUCCEEDED": 9_000, "READY": 998},
        attempts=9_100,
        first_started_at=at(4),
        last_finished_at=at(80),
        unfinished_started=0,
    )
    return replace(base, **changes)


def test_a_map_is_followed_by_its_items_and_one_row_for_the_rest() -> None:
    mapped = a_map()
    after = task("merge", state="PENDING", eligible_at=None)
    drawn = lay_out(facts(*mapped, after, rests=(rest(mapped[0].id),)))
    assert [(r.kind, r.name, r.depth) for r in drawn.rows] == [
        ("task", "process", 0),
        ("item", "process[0]", 1),
        ("item", "process[1]", 1),
        ("more", "process", 1),
        ("task", "merge", 0),
    ]
    more = drawn.rows[3]
    assert more.label == "+ 9,998 more items" and more.n == 9_998
    assert more.counts == {"READY": 998, "SUCCEEDED": 9_000} and more.attempts == 9_100
    assert kinds(more) == [("items", 4, 80, False)]
    assert drawn.rows[1].label == "[0]" and drawn.rows[1].map_id == mapped[0].id


def test_a_rest_with_items_running_is_open_and_one_with_none_started_is_empty() -> None:
    mapped = a_map(items=0)
    running = rest(mapped[0].id, unfinished_started=3, n=1)
    drawn = lay_out(facts(*mapped, rests=(running,), now=90))
    assert [r.kind for r in drawn.rows] == ["task", "more"]  # after the map when none is shown
    assert drawn.rows[1].label == "+ 1 more item"
    assert kinds(drawn.rows[1]) == [("items", 4, 90, True)]
    idle = rest(mapped[0].id, first_started_at=None, last_finished_at=None)
    assert lay_out(facts(*mapped, rests=(idle,))).rows[1].segments == ()


def test_each_maps_rest_follows_its_own_items() -> None:
    first, second = a_map("a", items=1), a_map("b", items=1)
    rests = (rest(first[0].id), rest(second[0].id, n=5))
    drawn = lay_out(facts(*first, *second, rests=rests))
    assert [(r.kind, r.name) for r in drawn.rows] == [
        ("task", "a"),
        ("item", "a[0]"),
        ("more", "a"),
        ("task", "b"),
        ("item", "b[0]"),
        ("more", "b"),
    ]


def test_tasks_left_out_are_one_last_row() -> None:
    drawn = lay_out(facts(task("a"), task("b"), tasks_total=1_502, limits=TimelineLimits(tasks=2)))
    last = drawn.rows[-1]
    assert (last.kind, last.n, last.segments) == ("omitted", 1_500, ())
    assert last.label == "+ 1,500 more tasks (the first 2 are shown)"
    assert [r.kind for r in lay_out(facts(task("a"))).rows] == ["task"]


def test_shown_items_counts_each_maps_items_and_zero_for_a_map_with_none() -> None:
    first, second = a_map("a", items=3), a_map("b", items=0)
    assert shown_items((*first, task("x"), *second)) == {first[0].id: 3, second[0].id: 0}
    assert shown_items((task("x"),)) == {}


@pytest.mark.parametrize("name", ["tasks", "items", "item_rows", "attempts"])
def test_a_limit_below_one_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        TimelineLimits(**{name: 0})


def test_a_long_name_is_shortened_to_the_label_column() -> None:
    row = only(lay_out(facts(task("x" * 200))))
    assert row.name == "x" * 200 and len(row.label) < 40 and row.label.endswith("\u2026")
    assert LABEL_WIDTH > 0


# ------------------------------------------------------------------ the axis


def test_the_axis_spans_the_run_to_now_or_to_its_finish() -> None:
    going = lay_out(facts(task(state="READY"), now=42))
    assert (going.start, going.end, going.span_s) == (T0, at(42), 42)
    done = lay_out(facts(task(attempts=(attempt(1, 1, 2, "succeeded"),)), now=500, finished=30))
    assert (done.end, done.span_s) == (at(30), 30)


def test_an_axis_read_at_once_is_at_least_a_second() -> None:
    drawn = lay_out(facts(task(state="PENDING", eligible_at=None), now=0))
    assert drawn.span_s == 1.0 and drawn.ticks[0].s == 0


@pytest.mark.parametrize(
    ("span", "step", "count"),
    [
        (1.0, 0.2, 6),
        (10, 2, 6),
        (59, 10, 6),
        (600, 120, 6),
        (3 * 3600, 1800, 7),
        (40 * 86400, 7 * 86400, 6),
    ],
)
def test_ticks_take_the_smallest_round_step_that_fits(span: float, step: float, count: int) -> None:
    found = ticks(span)
    assert len(found) == count
    assert [t.s for t in found] == [round(i * step, 3) for i in range(count)]
    assert found[0].label == "0s"


def test_half_second_ticks_read_apart() -> None:
    labels = [t.label for t in ticks(3.8)]
    assert labels == ["0s", "500ms", "1s", "1.5s", "2s", "2.5s", "3s", "3.5s"]
    assert len(set(labels)) == len(labels)


def test_ticks_stay_bounded_on_any_span() -> None:
    for span in (0.001, 1, 7, 123.4, 86400 * 3, 86400 * 5000):
        assert 1 <= len(ticks(span)) <= 60


@pytest.mark.parametrize(
    ("seconds", "label"),
    [
        (0, "0s"),
        (0.25, "250ms"),
        (1.5, "1.5s"),
        (2.5, "2.5s"),
        (45, "45s"),
        (90, "1m 30s"),
        (7200, "2h"),
        (93784, "1d 2h"),
    ],
)
def test_durations_read_in_their_two_largest_units(seconds: float, label: str) -> None:
    assert duration_label(seconds) == label


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (None, None),
        ("", None),
        ("  \n\t\n", None),
        ("\n  first  \nsecond", "first"),
        ("<b>x</b>", "<b>x</b>"),
        ("a" * 300, "a" * 199 + "\u2026"),
    ],
)
def test_an_error_shows_its_first_line_cut(text: str | None, line: str | None) -> None:
    assert first_line(text) == line


# ------------------------------------------------------------------ any history


@st.composite
def histories(draw: st.DrawFn) -> tuple[TimelineTask, float]:
    """A worker task with 0-6 attempts at increasing times, maybe one still running."""
    n = draw(st.integers(0, 6))
    clock = draw(st.floats(0, 10))
    eligible = clock
    attempts = []
    for i in range(1, n + 1):
        clock += draw(st.floats(0, 20))
        start = clock
        clock += draw(st.floats(0, 20))
        last_running = i == n and draw(st.booleans())
        attempts.append(
            attempt(
                i, start, None if last_running else clock, "running" if last_running else "failed"
            )
        )
    state = draw(st.sampled_from(["READY", "RUNNING", "RETRYING", "SUCCEEDED", "DEAD"]))
    now = clock + draw(st.floats(0, 30))
    return task(state=state, eligible_at=at(eligible), attempts=tuple(attempts)), now


@settings(max_examples=200, deadline=None)
@given(histories())
def test_segments_are_ordered_never_overlap_and_stay_on_the_axis(
    history: tuple[TimelineTask, float],
) -> None:
    one, now = history
    drawn = lay_out(facts(one, now=now))
    segments = only(drawn).segments
    assert [s.attempt for s in segments if s.kind == "attempt"] == [a.attempt for a in one.attempts]
    for segment in segments:
        assert 0 <= segment.start_s <= segment.end_s <= drawn.span_s
    for before, after in pairwise(segments):
        assert before.end_s <= after.start_s
