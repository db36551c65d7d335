"""``Client.wait``'s loop (flowforge/waiting.py) over a fake clock: bounded, never busy, the
deadline kept to the read, every bad timeout refused by class; and ``status --wait``'s exit
codes and refusals (flowforge/cli/wait.py) without a database."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main
from flowforge.cli.wait import BY_STATE, Outcome, exit_code
from flowforge.domain.model import Run, TaskRun
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError, NotFoundError, WaitTimeoutError
from flowforge.waiting import FIRST_INTERVAL_S, MAX_INTERVAL_S, wait_for_run, wait_timeout


def _task(name: str, state: TaskState, waiting_on: str | None = None) -> TaskRun:
    return TaskRun(
        uuid4(), uuid4(), name, "h", state, 1, 3, 1, None, None, None, None, None, None, None,
        None, False, datetime.now(UTC), None, None, None, waiting_on=waiting_on,
    )  # fmt: skip


def _run(state: RunState, *tasks: TaskRun) -> Run:
    return Run(uuid4(), "w", state, {}, None, False, datetime.now(UTC), None, None, tasks)


class Clock:
    """A monotonic clock that moves only when the waiter sleeps; every sleep is recorded."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _reads(*states: RunState) -> tuple[list[int], Any]:
    """A reader returning runs in these states one after another (the last one forever)."""
    count = [0]
    runs: Iterator[RunState] = iter(states)
    last = [states[0]]

    def read() -> Run:
        count[0] += 1
        last[0] = next(runs, last[0])
        return _run(last[0], _task("a", TaskState.RUNNING))

    return count, read


def test_a_finished_run_is_returned_at_the_first_read_without_a_pause() -> None:
    clock = Clock()
    count, read = _reads(RunState.SUCCEEDED)
    assert wait_for_run(read, 10, clock=clock, sleep=clock.sleep).state is RunState.SUCCEEDED
    assert count == [1] and clock.sleeps == []


@pytest.mark.parametrize("final", [RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED])
def test_each_final_state_ends_the_wait(final: RunState) -> None:
    clock = Clock()
    count, read = _reads(RunState.PENDING, RunState.RUNNING, RunState.RUNNING, final)
    assert wait_for_run(read, 60, clock=clock, sleep=clock.sleep).state is final
    assert count == [4]


def test_the_pause_doubles_from_the_first_interval_to_the_cap_and_is_never_zero() -> None:
    clock = Clock()
    _, read = _reads(RunState.RUNNING)
    with pytest.raises(WaitTimeoutError):
        wait_for_run(read, 30, clock=clock, sleep=clock.sleep)
    assert clock.sleeps[:3] == [FIRST_INTERVAL_S, FIRST_INTERVAL_S * 2, FIRST_INTERVAL_S * 4]
    assert all(0 < s <= MAX_INTERVAL_S for s in clock.sleeps)
    assert clock.sleeps[-2] == MAX_INTERVAL_S
    # about one read per second once the pause is at its cap: 30 s costs tens of reads
    assert len(clock.sleeps) < 30 + 10


def test_the_timeout_is_kept_to_the_deadline_and_carries_the_last_run_read() -> None:
    clock = Clock()
    count, read = _reads(RunState.SCHEDULED)
    with pytest.raises(WaitTimeoutError) as raised:
        wait_for_run(read, 2.5, clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(102.5)  # the last pause cut to what was left
    assert raised.value.run is not None and raised.value.run.state is RunState.SCHEDULED
    assert count[0] == len(clock.sleeps) + 1  # read once more at the deadline
    assert "still SCHEDULED after waiting 2.5s" in str(raised.value)


def test_a_run_that_finishes_during_the_last_pause_is_returned_not_a_timeout() -> None:
    clock = Clock()
    states = [RunState.RUNNING] * 5 + [RunState.SUCCEEDED]
    _, read = _reads(*states)
    # 0.05 + 0.1 + 0.2 + 0.4 = 0.75 s of pauses before the fifth read; the sixth is at 1.0
    assert wait_for_run(read, 1.0, clock=clock, sleep=clock.sleep).state is RunState.SUCCEEDED


def test_a_read_error_propagates_at_once() -> None:
    clock = Clock()

    def read() -> Run:
        raise NotFoundError("no run with id x")

    with pytest.raises(NotFoundError):
        wait_for_run(read, 10, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []


def test_the_timeout_message_names_unfinished_tasks_escaped_and_bounded() -> None:
    tasks = [_task(f"t{i}", TaskState.PENDING, "concurrency") for i in range(7)]
    tasks.append(_task("evil\x1b[31m", TaskState.RETRYING))
    tasks.append(_task("done", TaskState.SUCCEEDED))
    run = _run(RunState.RUNNING, *tasks)
    clock = Clock()
    with pytest.raises(WaitTimeoutError) as raised:
        wait_for_run(lambda: run, 0.1, clock=clock, sleep=clock.sleep)
    text = str(raised.value)
    assert "t0 PENDING (waiting on concurrency)" in text
    assert "and 3 more" in text and "done" not in text and "\x1b" not in text
    assert "\n" not in text


def test_a_pending_run_at_the_timeout_asks_whether_a_tree_runs() -> None:
    clock = Clock()
    run = _run(RunState.PENDING, _task("a", TaskState.READY))
    with pytest.raises(WaitTimeoutError, match="is a tree running"):
        wait_for_run(lambda: run, 0.1, clock=clock, sleep=clock.sleep)


@pytest.mark.parametrize(
    "bad",
    [None, True, "10", b"10", [10], 0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf,
     366 * 86_400 + 1, timedelta(0), timedelta(seconds=-3)],
    ids=repr,
)  # fmt: skip
def test_every_class_of_bad_timeout_is_an_input_error(bad: Any) -> None:
    with pytest.raises(InputError, match="timeout"):
        wait_timeout(bad)


@pytest.mark.parametrize(
    ("given", "seconds"), [(1, 1.0), (0.25, 0.25), (timedelta(minutes=2), 120.0)]
)
def test_good_timeouts_are_seconds(given: Any, seconds: float) -> None:
    assert wait_timeout(given) == seconds


def test_a_wait_timeout_is_a_flowforge_error_exported_at_the_top() -> None:
    import flowforge

    assert flowforge.WaitTimeoutError is WaitTimeoutError
    assert WaitTimeoutError("x").run is None


# --- status --wait, without a database ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["status", "x", "--timeout", "5"], "--timeout needs --wait"),
        (["status", "x", "--wait", "--timeout", "0"], "--timeout must be more than 0"),
        (["status", "x", "--wait", "--timeout", "-3"], "--timeout"),
        (["status", "x", "--wait", "--timeout", "soon"], "not a duration"),
        (["status", "x", "--wait", "--timeout", "1e9"], "not a duration"),
        (["status", "x", "--wait", "--timeout", "400d"], "at most"),
        (["status", "x", "--wait", "--timeout", "nan"], "not a duration"),
        (["status", "x", "--wait", "--timeout", "5\x00"], "not a duration"),
    ],
)
def test_a_bad_timeout_is_one_line_and_exit_2_before_any_connection(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a database URL that cannot be reached: had the command connected, it would say so
    monkeypatch.setenv("FLOWFORGE_DATABASE_URL", "postgresql://127.0.0.1:1/none")
    assert main(argv) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert err.startswith("flowforge: ") and said in err and err.count("\n") == 1


def test_the_exit_codes_by_final_state_are_distinct_and_documented() -> None:
    codes = {*BY_STATE.values(), exitcodes.WAIT_TIMEOUT}
    assert len(codes) == 4 and exitcodes.OK in codes
    assert not codes & {exitcodes.USAGE, exitcodes.NOT_FOUND, exitcodes.UNAVAILABLE}
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for code in codes - {exitcodes.OK}:
        assert f"| {code} |" in readme


@pytest.mark.parametrize("state", list(BY_STATE))
def test_status_without_wait_exits_0_whatever_the_state(state: RunState) -> None:
    assert exit_code(Outcome(_run(state)), waited=False) == exitcodes.OK
    assert exit_code(Outcome(_run(state)), waited=True) == BY_STATE[state]


def test_a_timed_out_wait_says_one_line_and_exits_10(capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(RunState.RUNNING)
    timed_out = WaitTimeoutError("run x is still RUNNING\nafter", run)
    assert exit_code(Outcome(run, timed_out), waited=True) == exitcodes.WAIT_TIMEOUT
    assert capsys.readouterr().err.count("\n") == 1
