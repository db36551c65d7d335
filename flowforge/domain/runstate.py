"""Deriving a workflow run's state from its task runs: one precedence rule, as data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flowforge.domain.states import FINISHED_TASK_STATES, RunState, TaskState

#: Run states a run leaves only through an operator's requeue; a run is in one of them exactly
#: when it is finished (``finished_at`` is set), never while a task of it can still change.
TERMINAL_RUN_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})

#: Task states that do not, by themselves, mean the run has started.
_NOT_STARTED = frozenset({TaskState.PENDING, TaskState.READY})


@dataclass(frozen=True)
class RunFacts:
    """Aggregate facts about one run's tasks, as the scheduler reads them in one query."""

    counts: Mapping[TaskState, int] = field(default_factory=dict)
    any_attempted: bool = False  # some task has been claimed at least once
    cancel_requested: bool = False  # an operator cancelled the run
    start_gate_closed: bool = False  # a delayed run whose start time has not come yet
    deadline_exceeded: bool = False  # the run's deadline passed: it ends FAILED
    skipped: int = 0  # CANCELLED tasks whose cause is condition_not_met (a run_if skip)

    def count(self, state: TaskState) -> int:
        return self.counts.get(state, 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> bool:
        """True when no task of the run can change without an operator.

        SUCCEEDED, DEAD and CANCELLED are settled (a DEAD task stays so until an audited
        requeue, whatever its ``on_dead``); PENDING, READY, RUNNING, FAILED and RETRYING can
        still move. An empty run is not finished.
        """
        return self.total > 0 and all(
            state in FINISHED_TASK_STATES for state, n in self.counts.items() if n
        )

    @property
    def started(self) -> bool:
        """Some task was claimed once, or is in a state only a claim leads to."""
        return self.any_attempted or any(n for s, n in self.counts.items() if s not in _NOT_STARTED)


Rule = tuple[str, Callable[[RunFacts], bool], RunState]

#: First matching rule wins. A run is terminal only when no task of it can still change: while
#: one can (a sibling running or retrying beside a DEAD task without fail-fast, a sibling that
#: fail-fast, a deadline or an operator asked to stop and that has not stopped yet), the run is
#: RUNNING (SCHEDULED while its start gate is closed, else PENDING if nothing has started).
#: Once settled, a passed deadline makes the run FAILED although it cancelled the tasks (the
#: cancellations are its consequence); an operator's cancellation beats a failure; otherwise a
#: DEAD task makes the run FAILED even when fail-fast cancelled its dependents (those
#: cancellations are a consequence of the failure, not an operator's decision) and even when a
#: compensation (``run_if: any_failed``) succeeded. A ``run_if`` skip (CANCELLED, cause
#: ``condition_not_met``) is no cancellation: a saga whose refund was skipped SUCCEEDED.
PRECEDENCE: tuple[Rule, ...] = (
    ("a task can still change", lambda f: not f.finished and f.started, RunState.RUNNING),
    (
        "its start time has not come",
        lambda f: not f.finished and f.start_gate_closed,
        RunState.SCHEDULED,
    ),
    ("nothing started yet", lambda f: not f.finished, RunState.PENDING),
    ("deadline exceeded", lambda f: f.deadline_exceeded, RunState.FAILED),
    (
        "operator cancelled",
        lambda f: f.cancel_requested and f.count(TaskState.CANCELLED) > 0,
        RunState.CANCELLED,
    ),
    ("a task is dead", lambda f: f.count(TaskState.DEAD) > 0, RunState.FAILED),
    (
        "a task is cancelled (not a skip)",
        lambda f: f.count(TaskState.CANCELLED) > f.skipped,
        RunState.CANCELLED,
    ),
    (
        "every task succeeded or was skipped",
        lambda f: f.count(TaskState.SUCCEEDED) + f.skipped == f.total,
        RunState.SUCCEEDED,
    ),
)


def derive(facts: RunFacts) -> RunState:
    """The run state for ``facts``; an empty run, or one where nothing started, is PENDING.

    The result is in :data:`TERMINAL_RUN_STATES` exactly when ``facts.finished``.
    """
    for _name, matches, state in PRECEDENCE:
        if matches(facts):
            return state
    return RunState.PENDING  # unreachable: a finished run matches one of the last rules
