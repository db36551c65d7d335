"""domain/control.py: what each operator action does to a task in each state (pure)."""

from __future__ import annotations

import uuid

import pytest

from flowforge.domain import transitions
from flowforge.domain.control import TARGET, Action, Effect, TaskFacts, plan, why_holds
from flowforge.domain.states import TaskState as S
from flowforge.errors import WrongStateError

ID = uuid.UUID(int=1)


def facts(
    state: S, needs_worker: bool = True, is_map: bool = False, cancel_requested: bool = False
) -> TaskFacts:
    return TaskFacts(state, needs_worker, is_map, cancel_requested)


@pytest.mark.parametrize("action", [Action.CANCEL, Action.BURY])
@pytest.mark.parametrize("state", [S.PENDING, S.READY, S.RETRYING, S.FAILED])
def test_cancel_and_bury_end_a_task_not_started_at_once(action: Action, state: S) -> None:
    assert plan(action, ID, facts(state)) is Effect.NOW
    assert transitions.is_legal(state, TARGET[action])


@pytest.mark.parametrize("action", [Action.CANCEL, Action.BURY])
def test_a_running_task_is_asked_to_stop_once(action: Action) -> None:
    assert plan(action, ID, facts(S.RUNNING)) is Effect.STOP
    assert transitions.is_legal(S.RUNNING, TARGET[action])  # where its stop ends it
    with pytest.raises(WrongStateError, match="already asked to stop"):
        plan(action, ID, facts(S.RUNNING, cancel_requested=True))


@pytest.mark.parametrize("action", [Action.CANCEL, Action.BURY])
def test_a_timer_or_event_wait_ends_at_once_a_running_map_is_refused(action: Action) -> None:
    assert plan(action, ID, facts(S.RUNNING, needs_worker=False)) is Effect.NOW
    with pytest.raises(WrongStateError, match="RUNNING map"):
        plan(action, ID, facts(S.RUNNING, needs_worker=False, is_map=True))


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("state", [S.SUCCEEDED, S.DEAD, S.CANCELLED])
def test_a_finished_task_is_refused_naming_its_state(action: Action, state: S) -> None:
    with pytest.raises(WrongStateError, match=f"is {state}"):
        plan(action, ID, facts(state))


@pytest.mark.parametrize("state", [s for s in S if s is not S.RETRYING])
def test_retry_now_takes_a_retrying_task_only(state: S) -> None:
    assert plan(Action.RETRY_NOW, ID, facts(S.RETRYING)) is Effect.NOW
    with pytest.raises(WrongStateError, match=f"is {state}: only a RETRYING task"):
        plan(Action.RETRY_NOW, ID, facts(state))


def test_why_a_task_holds_its_stream() -> None:
    assert "on_dead: block" in why_holds(S.DEAD, "block", 0, False)
    assert why_holds(S.RUNNING, "release", 0, True) == "running; asked to stop"
    assert why_holds(S.PENDING, "release", 2, False) == "waiting for 2 dependencies"
    assert why_holds(S.PENDING, "release", 1, False) == "waiting for 1 dependency"
    assert "READY" in why_holds(S.READY, "release", 0, False)
    assert "backoff" in why_holds(S.RETRYING, "release", 0, False)


def test_a_bury_requested_while_it_ran_buries_whatever_the_attempt_did() -> None:
    """The stop a bury asked for ends the task DEAD ``operator``: routing and reaping decide
    Bury before Cancel (a bury also sets cancel_requested)."""
    from flowforge.domain.policy import Bury, FailureFacts, RetryPolicy, decide
    from flowforge.domain.reasons import FailureReason

    for reason in (FailureReason.HANDLER_ERROR, FailureReason.LEASE_EXPIRED):
        facts_ = FailureFacts(reason, 1, 0, cancel_requested=True, bury_requested=True)
        assert decide(RetryPolicy(), facts_, lambda: 0.5) == Bury(FailureReason.OPERATOR)
