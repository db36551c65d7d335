"""The task-run state machine, as data: table shape, check(), reachability."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.domain.states import NOT_STARTED_TASK_STATES, TaskState
from flowforge.domain.transitions import TRANSITIONS, check, is_legal
from flowforge.errors import IllegalTransitionError

FAST = settings(database=None, deadline=None, max_examples=200)

LEGAL = [(s, t) for s, targets in TRANSITIONS.items() for t in sorted(targets)]
ILLEGAL = [(s, t) for s, t in itertools.product(TaskState, TaskState) if t not in TRANSITIONS[s]]


def test_table_has_an_entry_for_every_state() -> None:
    assert set(TRANSITIONS) == set(TaskState)


def test_table_targets_are_all_task_states() -> None:
    for targets in TRANSITIONS.values():
        assert targets <= set(TaskState)


def test_succeeded_leaves_only_through_a_rerun_to_pending() -> None:
    # `flowforge rerun --from TASK` resets a finished run's success (audited); nothing else
    assert TRANSITIONS[TaskState.SUCCEEDED] == frozenset({TaskState.PENDING})


def test_dead_leaves_only_through_requeue_to_pending() -> None:
    assert TRANSITIONS[TaskState.DEAD] == frozenset({TaskState.PENDING})


def test_only_ready_transitions_to_itself_a_redispatch() -> None:
    # READY → READY is the re-dispatch of a message the broker lost (a new token); no other
    # state may move to itself
    for state, targets in TRANSITIONS.items():
        assert (state in targets) == (state is TaskState.READY)


def test_every_not_started_state_can_be_cancelled() -> None:
    for state in NOT_STARTED_TASK_STATES:
        assert is_legal(state, TaskState.CANCELLED)


@pytest.mark.parametrize(("source", "target"), LEGAL)
def test_check_accepts_legal_transition(source: TaskState, target: TaskState) -> None:
    check(source, target)  # must not raise
    assert is_legal(source, target)


@pytest.mark.parametrize(("source", "target"), ILLEGAL)
def test_check_raises_for_illegal_transition(source: TaskState, target: TaskState) -> None:
    with pytest.raises(IllegalTransitionError) as info:
        check(source, target)
    assert str(source) in str(info.value) and str(target) in str(info.value)
    assert not is_legal(source, target)


def test_check_accepts_iterable_of_legal_sources() -> None:
    check(NOT_STARTED_TASK_STATES, TaskState.CANCELLED)
    check([TaskState.FAILED, TaskState.RUNNING], TaskState.DEAD)
    check((s for s in (TaskState.PENDING, TaskState.RETRYING)), TaskState.READY)


def test_check_raises_when_any_source_of_iterable_is_illegal() -> None:
    with pytest.raises(IllegalTransitionError, match="SUCCEEDED -> CANCELLED"):
        check([TaskState.PENDING, TaskState.SUCCEEDED], TaskState.CANCELLED)


def test_check_raises_for_illegal_source_listed_last_in_iterable() -> None:
    sources = [*sorted(NOT_STARTED_TASK_STATES), TaskState.DEAD]
    with pytest.raises(IllegalTransitionError):
        check(sources, TaskState.CANCELLED)


def test_every_state_is_reachable_from_pending() -> None:
    seen = {TaskState.PENDING}
    frontier = [TaskState.PENDING]
    while frontier:
        state = frontier.pop()
        for nxt in TRANSITIONS[state]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(TaskState)


@FAST
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=60))
def test_every_legal_path_from_pending_stays_in_the_table(choices: list[int]) -> None:
    state = TaskState.PENDING
    for choice in choices:
        targets = sorted(TRANSITIONS[state])
        assert targets, f"{state} has no way out"
        nxt = targets[choice % len(targets)]
        check(state, nxt)
        assert nxt in TRANSITIONS
        state = nxt
    assert state in set(TaskState)


@FAST
@given(st.sampled_from(list(TaskState)), st.sampled_from(list(TaskState)))
def test_check_agrees_with_is_legal(source: TaskState, target: TaskState) -> None:
    if is_legal(source, target):
        check(source, target)
    else:
        with pytest.raises(IllegalTransitionError):
            check(source, target)
