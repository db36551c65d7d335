"""When a task with a ``run_if`` condition runs (SPEC 7.3): cleanup and compensation steps.

A task runs by default when all its dependencies SUCCEEDED (``all_succeeded``; a dead or
cancelled dependency cancels it). A conditional task waits instead until every dependency is
finished (SUCCEEDED, DEAD or CANCELLED) and then runs or is skipped by :func:`decide`. A skipped
task is CANCELLED with cause ``condition_not_met`` (no new state: SPEC 2's list is closed);
the run-state precedence does not count it as a cancellation (``domain/runstate.py``).
Pure: the scheduler's ``evaluate_conditions`` pass reads the facts and applies the verdicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from flowforge.domain.states import FINISHED_TASK_STATES, TaskState


class RunIf(StrEnum):
    """A task's condition on its dependencies' outcomes. The spelling is public."""

    ALL_SUCCEEDED = "all_succeeded"  # the default: every dependency SUCCEEDED
    ALL_DONE = "all_done"  # every dependency finished, whatever the outcome (cleanup)
    ANY_FAILED = "any_failed"  # at least one dependency ended DEAD (compensation)


class Verdict(StrEnum):
    """What the evaluation of a conditional task decides."""

    WAIT = "wait"  # a dependency can still change
    RUN = "run"  # the condition holds: the task becomes eligible (its gate opens)
    SKIP = "skip"  # the condition can never hold: CANCELLED, cause condition_not_met


def is_conditional(run_if: RunIf | str) -> bool:
    """Whether the task is held by a condition gate (anything but the default)."""
    return RunIf(run_if) is not RunIf.ALL_SUCCEEDED


def decide(run_if: RunIf | str, upstream: Iterable[TaskState | str]) -> Verdict:
    """The verdict for a conditional task whose dependencies are in the states ``upstream``.

    ``all_succeeded`` is not evaluated here (its dependents are released by each success and
    cancelled by a death): asking for it raises ValueError, as does a task with no dependency.
    """
    condition = RunIf(run_if)
    if condition is RunIf.ALL_SUCCEEDED:
        raise ValueError("all_succeeded is not a gated condition")
    states = [TaskState(s) for s in upstream]
    if not states:
        raise ValueError("a conditional task has at least one dependency")
    if any(s not in FINISHED_TASK_STATES for s in states):
        return Verdict.WAIT
    if condition is RunIf.ALL_DONE:
        return Verdict.RUN
    return Verdict.RUN if TaskState.DEAD in states else Verdict.SKIP
