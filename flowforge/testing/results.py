"""What an in-process run (:class:`~flowforge.testing.LocalRunner`) did, to assert on.

The shapes follow the engine's read models where they can (``Run``, ``TaskRun``, attempts):
the same states, failure reasons and cancel causes, so an assertion written against a local
run reads like one against ``Client.status``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowforge.domain.conditions import RunIf
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import CancelCause, RunState, TaskState

#: The outcome of an attempt that did not call the handler: its idempotency key had SUCCEEDED
#: before, and the stored result was used (as the engine's attempt outcome says).
REUSED = "reused"


@dataclass(frozen=True)
class LocalAttempt:
    """One attempt: ``outcome`` a task state (SUCCEEDED, FAILED) or :data:`REUSED`;
    ``retry_delay_s`` the backoff the engine would wait before the next attempt (None after
    the last one); ``duration_s`` how long the handler ran, in seconds."""

    number: int
    outcome: str
    reason: FailureReason | None = None
    error: str | None = None
    traceback: str | None = None
    duration_s: float = 0.0
    retry_delay_s: float | None = None


@dataclass
class LocalTask:
    """One task of a local run (or one item of a map: ``name`` is ``map[index]``).

    ``result`` is the JSON value downstream tasks receive (after the worker's checks, read back
    from JSON: tuples are lists, keys are strings); ``given`` says it came from the caller's
    ``upstream=`` instead of an execution. ``items`` are a map's items in order, ``children``
    the child runs of a ``workflow:`` task (one per attempt)."""

    name: str
    state: TaskState
    run_if: RunIf = RunIf.ALL_SUCCEEDED
    result: Any = None
    failure_reason: FailureReason | None = None
    error: str | None = None
    cancel_cause: CancelCause | None = None
    attempts: list[LocalAttempt] = field(default_factory=list)
    items: list[LocalTask] = field(default_factory=list)
    children: list[LocalRun] = field(default_factory=list)
    idempotency_key: str | None = None
    given: bool = False

    @property
    def attempt(self) -> int:
        """Attempts used (the engine's ``attempt`` column)."""
        return len(self.attempts)

    @property
    def skipped(self) -> bool:
        """A ``run_if`` skip (or downstream of skips only): CANCELLED, not a failure."""
        return self.cancel_cause is CancelCause.CONDITION_NOT_MET

    def line(self) -> str:
        """One line for a summary: state, attempts, reason and the first line of the error."""
        parts = [f"{self.name}: {self.state}"]
        if self.attempts:
            parts.append(f"after {self.attempt} attempt(s)")
        if self.failure_reason is not None:
            parts.append(f"reason {self.failure_reason}")
        if self.cancel_cause is not None:
            parts.append(f"cause {self.cancel_cause}")
        if self.error:
            parts.append(f"error {self.error.splitlines()[0] if self.error.strip() else ''!r}")
        return ", ".join(parts)


@dataclass
class LocalRun:
    """One workflow run executed in-process: its tasks by name in execution order (every task
    of the workflow has one), and the run state the engine's precedence derives from them."""

    workflow: str
    input: Mapping[str, Any]
    state: RunState
    tasks: dict[str, LocalTask]

    def task(self, name: str) -> LocalTask:
        """The task called ``name``; KeyError naming the run's tasks if there is none."""
        try:
            return self.tasks[name]
        except KeyError:
            known = list(self.tasks)
            raise KeyError(f"{name!r} is not a task of {self.workflow!r}: {known}") from None

    def __getitem__(self, name: str) -> LocalTask:
        return self.task(name)

    def __iter__(self) -> Iterator[LocalTask]:
        return iter(self.tasks.values())

    @property
    def results(self) -> dict[str, Any]:
        """The result of every task that SUCCEEDED, by name."""
        return {n: t.result for n, t in self.tasks.items() if t.state is TaskState.SUCCEEDED}

    @property
    def compensated(self) -> tuple[str, ...]:
        """The ``run_if: any_failed`` tasks that SUCCEEDED (as ``Run.compensated``)."""
        return tuple(
            t.name for t in self if t.run_if is RunIf.ANY_FAILED and t.state is TaskState.SUCCEEDED
        )

    def summary(self) -> str:
        """The run and one line per task (what an assertion failure shows)."""
        head = f"run of {self.workflow!r}: {self.state}"
        return "\n".join([head, *(f"  {t.line()}" for t in self)])

    def assert_succeeded(self) -> LocalRun:
        """The run itself if it SUCCEEDED; else AssertionError with :meth:`summary` and the
        last traceback of every task that failed."""
        if self.state is not RunState.SUCCEEDED:
            raise AssertionError(self._explained(f"expected SUCCEEDED, got {self.state}"))
        return self

    def assert_failed(
        self, task: str | None = None, reason: FailureReason | str | None = None
    ) -> LocalTask | None:
        """AssertionError unless the run FAILED — and, if given, ``task`` is DEAD (with
        ``reason``); returns that task (None when no task is named)."""
        if self.state is not RunState.FAILED:
            raise AssertionError(self._explained(f"expected FAILED, got {self.state}"))
        if task is None:
            return None
        found = self.task(task)
        if found.state is not TaskState.DEAD:
            raise AssertionError(self._explained(f"expected {task} DEAD, got {found.state}"))
        if reason is not None and found.failure_reason != FailureReason(reason):
            raise AssertionError(
                self._explained(f"expected {task} DEAD {reason}, got {found.failure_reason}")
            )
        return found

    def _explained(self, message: str) -> str:
        tracebacks = [
            f"--- {t.name}, attempt {t.attempt}:\n{t.attempts[-1].traceback}"
            for t in self._all_tasks()
            if t.attempts and t.attempts[-1].traceback
        ]
        return "\n".join([message, self.summary(), *tracebacks])

    def _all_tasks(self) -> Iterator[LocalTask]:
        for task in self:
            yield task
            yield from task.items
