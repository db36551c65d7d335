"""Deriving a workflow run's state from aggregate task facts (precedence as data)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.domain.runstate import PRECEDENCE, TERMINAL_RUN_STATES, RunFacts, derive
from flowforge.domain.states import FINISHED_TASK_STATES, RunState, TaskState
from flowforge.store import queries

FAST = settings(database=None, deadline=None, max_examples=300)
S = TaskState


def facts(attempted: bool = False, cancel: bool = False, **counts: int) -> RunFacts:
    return RunFacts(
        counts={S[name]: n for name, n in counts.items()},
        any_attempted=attempted,
        cancel_requested=cancel,
    )


def test_empty_run_is_pending() -> None:
    assert derive(RunFacts()) is RunState.PENDING


def test_empty_run_with_zero_counts_is_pending() -> None:
    assert derive(facts(PENDING=0, SUCCEEDED=0)) is RunState.PENDING


def test_all_succeeded_is_succeeded() -> None:
    assert derive(facts(attempted=True, SUCCEEDED=3)) is RunState.SUCCEEDED


def test_all_succeeded_ignores_zero_count_entries() -> None:
    assert derive(facts(attempted=True, SUCCEEDED=2, PENDING=0, DEAD=0)) is RunState.SUCCEEDED


def test_partly_succeeded_is_running() -> None:
    assert derive(facts(attempted=True, SUCCEEDED=1, PENDING=2)) is RunState.RUNNING


def test_any_dead_is_failed() -> None:
    assert derive(facts(attempted=True, SUCCEEDED=2, DEAD=1)) is RunState.FAILED


def test_dead_with_fail_fast_cancelled_dependents_is_failed() -> None:
    assert derive(facts(attempted=True, DEAD=1, CANCELLED=3)) is RunState.FAILED


def test_operator_cancel_with_cancelled_tasks_is_cancelled_even_with_dead() -> None:
    assert derive(facts(attempted=True, cancel=True, DEAD=1, CANCELLED=2)) is RunState.CANCELLED


def test_operator_cancel_without_cancelled_tasks_does_not_hide_dead() -> None:
    assert derive(facts(attempted=True, cancel=True, DEAD=1, SUCCEEDED=1)) is RunState.FAILED


# A run is terminal only when no task of it can still change (issue 15): a DEAD task beside
# tasks that still run, retry or wait keeps the run RUNNING, whatever made the others live on.


@pytest.mark.parametrize("state", [S.PENDING, S.READY, S.RUNNING, S.FAILED, S.RETRYING])
def test_dead_beside_a_task_that_can_still_change_is_running(state: TaskState) -> None:
    assert derive(facts(attempted=True, DEAD=1, SUCCEEDED=1, **{state.name: 1})) is RunState.RUNNING


def test_dead_with_fail_fast_cancelled_dependents_and_a_sibling_still_stopping_is_running() -> None:
    assert derive(facts(attempted=True, DEAD=1, CANCELLED=2, RUNNING=1)) is RunState.RUNNING


def test_operator_cancel_while_a_task_is_still_stopping_is_running() -> None:
    assert derive(facts(attempted=True, cancel=True, CANCELLED=3, RUNNING=1)) is RunState.RUNNING


def test_dead_once_everything_settled_is_failed() -> None:
    assert derive(facts(attempted=True, DEAD=1, SUCCEEDED=2, CANCELLED=1)) is RunState.FAILED


def test_cancelled_before_anything_started_is_cancelled() -> None:
    assert derive(facts(cancel=True, CANCELLED=4)) is RunState.CANCELLED


def test_cancelled_task_without_operator_request_is_cancelled() -> None:
    assert derive(facts(attempted=True, CANCELLED=1, SUCCEEDED=1)) is RunState.CANCELLED


def test_cancel_requested_while_tasks_still_running_is_running() -> None:
    assert derive(facts(attempted=True, cancel=True, RUNNING=2)) is RunState.RUNNING


@pytest.mark.parametrize("state", [S.RUNNING, S.FAILED, S.RETRYING, S.SUCCEEDED])
def test_a_started_state_makes_run_running(state: TaskState) -> None:
    assert derive(RunFacts(counts={state: 1, S.PENDING: 1})) is RunState.RUNNING


def test_ready_task_attempted_before_makes_run_running() -> None:
    assert derive(facts(attempted=True, READY=1, PENDING=1)) is RunState.RUNNING


def test_only_pending_and_ready_never_attempted_is_pending() -> None:
    assert derive(facts(attempted=False, READY=2, PENDING=3)) is RunState.PENDING


# Delayed runs and deadlines (issue 18): a closed start gate and a passed deadline are facts.


def test_a_run_whose_start_gate_is_closed_is_scheduled() -> None:
    assert derive(RunFacts({S.PENDING: 3}, start_gate_closed=True)) is RunState.SCHEDULED


def test_a_scheduled_run_cancelled_by_its_operator_is_cancelled() -> None:
    cancelled = RunFacts({S.CANCELLED: 3}, cancel_requested=True, start_gate_closed=True)
    assert derive(cancelled) is RunState.CANCELLED


def test_an_open_gate_with_nothing_started_is_pending() -> None:
    assert derive(RunFacts({S.PENDING: 2, S.READY: 1})) is RunState.PENDING


def test_a_passed_deadline_with_every_task_cancelled_is_failed_not_cancelled() -> None:
    assert derive(RunFacts({S.CANCELLED: 3}, deadline_exceeded=True)) is RunState.FAILED


def test_a_passed_deadline_with_some_successes_is_failed() -> None:
    settled = RunFacts({S.SUCCEEDED: 2, S.CANCELLED: 1}, True, deadline_exceeded=True)
    assert derive(settled) is RunState.FAILED


def test_a_passed_deadline_while_a_handler_still_runs_is_running() -> None:
    stopping = RunFacts({S.CANCELLED: 2, S.RUNNING: 1}, True, deadline_exceeded=True)
    assert derive(stopping) is RunState.RUNNING


def test_a_passed_deadline_beats_a_later_operator_cancel() -> None:
    both = RunFacts({S.CANCELLED: 2}, True, cancel_requested=True, deadline_exceeded=True)
    assert derive(both) is RunState.FAILED


def test_a_passed_deadline_on_a_run_that_succeeded_anyway_is_failed() -> None:
    """A handler that ignored ``ctx.cancelled`` and succeeded: the run still missed it."""
    assert derive(RunFacts({S.SUCCEEDED: 3}, True, deadline_exceeded=True)) is RunState.FAILED


def test_the_scheduled_rule_comes_before_pending_and_after_running() -> None:
    names = [name for name, _, _ in PRECEDENCE]
    scheduled = [name for name, _, state in PRECEDENCE if state is RunState.SCHEDULED]
    assert names.index("a task can still change") < names.index(scheduled[0])
    assert names.index(scheduled[0]) < names.index("nothing started yet")


def test_precedence_rules_have_unique_names() -> None:
    names = [name for name, _, _ in PRECEDENCE]
    assert len(names) == len(set(names))


def test_finished_is_false_for_empty_run() -> None:
    assert not RunFacts().finished


def test_finished_is_true_when_every_task_is_in_a_final_state() -> None:
    assert facts(SUCCEEDED=1, DEAD=1, CANCELLED=1).finished


def test_finished_ignores_zero_count_unfinished_states() -> None:
    assert facts(SUCCEEDED=2, RUNNING=0, PENDING=0).finished


@pytest.mark.parametrize("state", [S.PENDING, S.READY, S.RUNNING, S.FAILED, S.RETRYING])
def test_finished_is_false_while_a_task_can_still_move(state: TaskState) -> None:
    assert not RunFacts(counts={S.SUCCEEDED: 3, state: 1}).finished


def test_count_and_total_sum_counts() -> None:
    f = facts(SUCCEEDED=2, DEAD=1)
    assert (f.count(S.SUCCEEDED), f.count(S.RUNNING), f.total) == (2, 0, 3)


run_facts = st.builds(
    RunFacts,
    counts=st.dictionaries(st.sampled_from(list(TaskState)), st.integers(0, 5)),
    any_attempted=st.booleans(),
    cancel_requested=st.booleans(),
    start_gate_closed=st.booleans(),
    deadline_exceeded=st.booleans(),
)


@FAST
@given(run_facts)
def test_derive_is_total_and_consistent(f: RunFacts) -> None:
    state = derive(f)
    assert isinstance(state, RunState)
    if state is RunState.SUCCEEDED:
        assert f.total > 0
        assert all(n == 0 for s, n in f.counts.items() if s is not S.SUCCEEDED)
    if state is RunState.FAILED:
        assert f.count(S.DEAD) > 0 or f.deadline_exceeded
    if state is RunState.SCHEDULED:
        assert f.start_gate_closed and not f.started and not f.finished
    if state is RunState.CANCELLED:
        assert f.count(S.CANCELLED) > 0
    if state is RunState.PENDING:
        assert not f.any_attempted
        assert all(n == 0 for s, n in f.counts.items() if s not in (S.PENDING, S.READY))


@FAST
@given(run_facts)
def test_a_run_is_terminal_exactly_when_finished(f: RunFacts) -> None:
    """What ``update_run_states`` stores: a terminal state and ``finished_at`` go together."""
    assert (derive(f) in TERMINAL_RUN_STATES) == f.finished


@FAST
@given(run_facts)
def test_finished_matches_final_states(f: RunFacts) -> None:
    live = {s for s, n in f.counts.items() if n}
    assert f.finished == (bool(live) and live <= FINISHED_TASK_STATES)


def test_the_sql_that_picks_runs_to_derive_agrees_on_what_can_still_change() -> None:
    """``runs_to_derive`` re-derives a run once none of its tasks is in these states: the same
    set that :attr:`RunFacts.finished` (and so a terminal run state) is defined by."""
    sql = queries.readable()["runs_to_derive"].decode()
    found = re.search(r"t\.state IN \(([^)]*)\)", sql)
    assert found is not None
    unfinished = {S(name.strip().strip("'")) for name in found.group(1).split(",")}
    assert unfinished == set(TaskState) - FINISHED_TASK_STATES
