"""Deriving a workflow run's state from its task runs: one precedence rule, as data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flowforge.domain.states import FINISHED_TASK_STATES, RunState, TaskState


@dataclass(frozen=True)
class RunFacts:
    """Aggregate facts about one run's tasks, as the scheduler reads them in one query."""

    counts: Mapping[TaskState, int] = field(default_factory=dict)
    any_attempted: bool = False  # some task has been claimed at least once
    cancel_requested: bool = False  # an operator cancelled the run

    def count(self, state: TaskState) -> int:
        return self.counts.get(state, 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> bool:
        """True when no task of the run can change without an operator."""
        return self.total > 0 and all(
            state in FINISHED_TASK_STATES for state, n in self.counts.items() if n
        )


Rule = tuple[str, Callable[[RunFacts], bool], RunState]

#: First matching rule wins. An operator's cancellation beats a failure; otherwise a DEAD task
#: makes the run FAILED even when fail-fast cancelled its dependents (those cancellations are a
#: consequence of the failure, not an operator's decision).
PRECEDENCE: tuple[Rule, ...] = (
    (
        "operator cancelled",
        lambda f: f.cancel_requested and f.count(TaskState.CANCELLED) > 0,
        RunState.CANCELLED,
    ),
    ("a task is dead", lambda f: f.count(TaskState.DEAD) > 0, RunState.FAILED),
    ("a task is cancelled", lambda f: f.count(TaskState.CANCELLED) > 0, RunState.CANCELLED),
    (
        "every task succeeded",
        lambda f: f.total > 0 and f.count(TaskState.SUCCEEDED) == f.total,
        RunState.SUCCEEDED,
    ),
    (
        "something started",
        lambda f: (
            f.any_attempted
            or any(f.count(s) for s in TaskState if s not in (TaskState.PENDING, TaskState.READY))
        ),
        RunState.RUNNING,
    ),
)


def derive(facts: RunFacts) -> RunState:
    """The run state for ``facts``; an empty run, or one where nothing started, is PENDING."""
    for _name, matches, state in PRECEDENCE:
        if matches(facts):
            return state
    return RunState.PENDING
