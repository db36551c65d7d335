"""Workflows in Python (SPEC 7.5): :class:`Workflow`, a builder equivalent to a workflow file.

A builder only *collects* what a workflow file would hold, as the same plain mapping, and
:meth:`Workflow.build` hands that mapping to the file loader
(:func:`~flowforge.definitions.workflow_from_mapping`): one validation path, so a definition
the YAML refuses is refused here with the same ``key.path: message``, and one accepted here
is equal (same digest) to its file form (``flowforge workflows export``). What Python adds is
converted first and nothing else: a ``timedelta`` becomes seconds, an enum its value, a
handler function its ``@flowforge.task`` name, a step function or a :class:`Workflow` its name,
a :class:`~flowforge.RetryPolicy` (or another definition class) its fields.

How a tree finds builders: the config's ``workflow_modules`` are imported and every
module-level :class:`Workflow` (or :class:`~flowforge.WorkflowDef`) is a workflow
(``flowforge/discovery.py``; docs/workflows-in-python.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from enum import Enum
from typing import Any, Literal, TypedDict, TypeVar, Unpack

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.breakers import CircuitBreaker
from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import OnDead, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.names import NAME_PATTERN
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.schedule import CatchUp, Overlap, ScheduleDef
from flowforge.errors import DefinitionError
from flowforge.handlers import MARK

F = TypeVar("F", bound=Callable[..., Any])

#: Seconds, where a workflow file takes a duration too: a number, a ``timedelta`` or text such
#: as ``"10m"`` (``sleep``, ``deadline``, an event's ``timeout``, a rate's ``per``, a breaker's
#: ``window`` and ``cooldown``).
Duration = float | timedelta | str
#: A number of seconds where a workflow file takes only a number (``timeout``, retry delays).
Seconds = float | timedelta
#: A task named by its name, or by the function a :meth:`Workflow.step` made a task of.
TaskRef = str | Callable[..., Any]


class RetrySpec(TypedDict, total=False):
    """``retry:`` (:class:`~flowforge.RetryPolicy`'s fields)."""

    max_attempts: int
    base_delay: Seconds
    max_delay: Seconds
    jitter: Jitter | Literal["full", "equal", "none"]


class EventSpec(TypedDict):
    """``wait_for_event:`` (:class:`~flowforge.EventWait`'s fields)."""

    name: str
    key: str
    timeout: Duration


class ConcurrencySpec(TypedDict):
    """``concurrency:`` (:class:`~flowforge.Concurrency`'s fields)."""

    key: str
    limit: int


class _RateLimitRequired(TypedDict):
    limit: int
    per: Duration


class RateLimitSpec(_RateLimitRequired, total=False):
    """``rate_limit:`` (:class:`~flowforge.RateLimit`'s fields)."""

    key: str


class _BreakerRequired(TypedDict):
    failures: int
    window: Duration
    cooldown: Duration


class BreakerSpec(_BreakerRequired, total=False):
    """``circuit_breaker:`` (:class:`~flowforge.CircuitBreaker`'s fields)."""

    key: str


class ScheduleSpec(TypedDict, total=False):
    """One of ``schedules:`` (:class:`~flowforge.ScheduleDef`'s fields)."""

    cron: str
    every: str
    timezone: str
    input: Mapping[str, Any]
    catch_up: CatchUp | Literal["skip", "latest", "all"]
    max_catch_up: int
    overlap: Overlap | Literal["allow", "skip", "cancel_previous"]
    name: str


class TaskOptions(TypedDict, total=False):
    """A task's keys beside its name and handler: those of a task in a workflow file, with the
    same meaning and rules (README, docs/dynamic.md, docs/flow-control.md, docs/time.md)."""

    depends_on: TaskRef | Sequence[TaskRef]
    retry: RetryPolicy | RetrySpec
    timeout: Seconds | None
    idempotency_key: str | None
    ordering_key: str | None
    on_dead: OnDead | Literal["release", "block"]
    sleep: Duration
    for_each: TaskRef
    max_parallel: int
    wait_for_event: EventWait | EventSpec
    run_if: RunIf | Literal["all_succeeded", "all_done", "any_failed"]
    workflow: str | Workflow
    input: Mapping[str, Any]
    queue: str
    concurrency: Concurrency | ConcurrencySpec
    rate_limit: RateLimit | RateLimitSpec
    priority: int
    circuit_breaker: CircuitBreaker | BreakerSpec


class Workflow:
    """A workflow defined in Python, equivalent to a workflow file.

    ``Workflow("name", deadline="2h")`` then ``.task(...)`` per task (or ``@.step(...)`` on
    handler functions) and ``.schedule(...)`` per schedule; :meth:`build` gives the validated
    :class:`~flowforge.WorkflowDef` (:class:`~flowforge.errors.DefinitionError` naming the key
    path, as for a file). Tasks keep the order they were added in.
    """

    def __init__(
        self,
        name: str,
        *,
        fail_fast: bool = True,
        deadline: Duration | None = None,
        max_items: int | None = None,
    ) -> None:
        self.name = name
        self._head: dict[str, Any] = {"name": name}
        if fail_fast is not True:  # only what differs from a file's default, as a file would
            self._head["fail_fast"] = fail_fast
        if deadline is not None:
            self._head["deadline"] = _plain(deadline)
        if max_items is not None:
            self._head["max_items"] = max_items
        self._tasks: list[dict[str, Any]] = []
        self._schedules: list[dict[str, Any]] = []
        self._steps: dict[Callable[..., Any], str] = {}

    def task(
        self, name: str, handler: str | Callable[..., Any] = "", **options: Unpack[TaskOptions]
    ) -> str:
        """Add task ``name`` run by ``handler`` (its name, or a function marked with
        ``@flowforge.task``; none for a ``sleep``, ``wait_for_event`` or ``workflow`` task).
        Returns ``name``, to be named in a later task's ``depends_on`` or ``for_each``."""
        entry: dict[str, Any] = {"name": name}
        if handler != "":
            entry["handler"] = self._handler_name(name, handler)
        for key, value in options.items():
            entry[key] = self._option(name, key, value)
        self._tasks.append(entry)
        return name

    def step(
        self, name: str | None = None, *, handler: str | None = None, **options: Unpack[TaskOptions]
    ) -> Callable[[F], F]:
        """Decorate a handler function to make it a task of this workflow (called ``name``,
        by default the function's name) and a handler (called ``handler``, by default its
        ``@flowforge.task`` name if it has one, else ``WORKFLOW.FUNCTION``). The function is
        returned as it is: list its module in the config's ``handlers`` too, so workers run it.
        """

        if callable(name):  # ``@flow.step`` without its parentheses: the task would be lost
            raise DefinitionError(
                f"workflow {self.name!r}: step needs its parentheses: @flow.step() or "
                "@flow.step('name', ...)"
            )

        def add(fn: F) -> F:
            marked = getattr(fn, MARK, None)
            handler_name = handler or marked or f"{self.name}.{fn.__name__}"
            if marked is None and NAME_PATTERN.fullmatch(handler_name):
                setattr(fn, MARK, handler_name)  # a bad name is refused by build(), at its key
            task_name = name or fn.__name__
            self.task(task_name, handler_name, **options)
            self._steps[fn] = task_name
            return fn

        return add

    def schedule(
        self, definition: ScheduleDef | None = None, /, **spec: Unpack[ScheduleSpec]
    ) -> None:
        """Add a schedule (one of ``schedules:`` in a workflow file; docs/schedules.md), given
        by its keys or as a :class:`~flowforge.ScheduleDef` (keys given beside it win)."""
        given = _plain(definition) if definition is not None else {}
        self._schedules.append({**given, **_plain(spec)})

    def to_mapping(self) -> dict[str, Any]:
        """What a workflow file of this workflow would hold, as parsed YAML."""
        data = {**self._head, "tasks": [dict(task) for task in self._tasks]}
        if self._schedules:
            data["schedules"] = [dict(schedule) for schedule in self._schedules]
        return data

    def build(self) -> WorkflowDef:
        """The validated definition, through the checks of a workflow file; a problem raises
        :class:`~flowforge.errors.DefinitionError` as ``workflow 'NAME': key.path: message``
        (``tasks[1].retry.max_attempts: ...``: the task's position in the order added)."""
        return workflow_from_mapping(self.to_mapping(), f"workflow {self.name!r}")

    def _handler_name(self, task: str, handler: str | Callable[..., Any]) -> Any:
        if callable(handler):
            marked = getattr(handler, MARK, None)
            if marked is None:
                raise DefinitionError(
                    f"workflow {self.name!r}: task {task!r}: handler "
                    f"{getattr(handler, '__qualname__', handler)!r} is not marked with "
                    "@flowforge.task (give its handler name, or use Workflow.step)"
                )
            return marked
        return handler

    def _option(self, task: str, key: str, value: Any) -> Any:
        if key == "input":  # the child run's input is JSON, checked as given
            return value
        if key == "depends_on" and not isinstance(value, str) and isinstance(value, Sequence):
            return [self._ref(task, key, v) for v in value]
        if key in ("depends_on", "for_each"):
            return self._ref(task, key, value)
        if isinstance(value, Workflow):  # workflow: a child run of that workflow
            return value.name
        return _plain(value)

    def _ref(self, task: str, key: str, ref: Any) -> Any:
        """A task named by a step function: its name (a function of no step is refused)."""
        if isinstance(ref, str) or not callable(ref):
            return ref  # a name, or a bad value the loader refuses at its key
        for fn, name in self._steps.items():  # by identity: a callable need not hash
            if fn is ref:
                return name
        raise DefinitionError(
            f"workflow {self.name!r}: task {task!r}: {key}: "
            f"{getattr(ref, '__qualname__', ref)!r} is not a step of this workflow"
        )


def _plain(value: Any) -> Any:
    """``value`` as a workflow file would hold it: seconds for a ``timedelta``, an enum's
    value, a definition class's fields (each made plain), anything else as it is (for the
    loader to judge)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, RetryPolicy | EventWait | Concurrency | RateLimit | CircuitBreaker):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, ScheduleDef):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, Mapping):  # a spec's keys; a child's or schedule's input stays as is
        return {k: v if k == "input" else _plain(v) for k, v in value.items()}
    return value
