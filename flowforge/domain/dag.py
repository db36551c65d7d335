"""Workflow definitions (a DAG of tasks) and their validation.

A :class:`WorkflowDef` validates itself on construction, so an invalid definition cannot exist.
A task's keys are templates over the run input (:mod:`flowforge.domain.keys`); its flow-control
limits live in :mod:`flowforge.domain.limits`, its event wait in :mod:`flowforge.domain.events`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from flowforge.domain import children
from flowforge.domain.breakers import CircuitBreaker, check_breaker_key
from flowforge.domain.conditions import RunIf
from flowforge.domain.events import EventWait
from flowforge.domain.keys import check_item_key, check_template, render_key, template_fields
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.names import check_name, priority_problem, queue_problem
from flowforge.domain.policy import RetryPolicy
from flowforge.domain.schedule import ScheduleDef, ScheduleError, default_name
from flowforge.domain.timing import MAX_SPAN_S
from flowforge.domain.values import to_json
from flowforge.errors import DefinitionError, InputError, UnstorableValueError

#: Longest per-task time limit accepted (one week), in seconds.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: Most items a map task (``for_each``) may expand to unless its workflow sets ``max_items``.
DEFAULT_MAX_ITEMS = 10_000
#: Bound on ``max_items`` and ``max_parallel`` themselves (one expansion is one transaction).
ITEMS_LIMIT = 1_000_000


class OnDead(StrEnum):
    """What a DEAD task does to its ordering-key stream."""

    RELEASE = "release"  # later tasks of the stream may proceed
    BLOCK = "block"  # the stream waits until the dead task is requeued and finishes


@dataclass(frozen=True)
class TaskDef:
    """One task of a workflow: which handler runs it and under which rules.

    A task with ``sleep`` (seconds) is a durable timer instead: it has no handler, holds no
    worker, and succeeds that long after its dependencies are met (on the database clock).

    A task with ``for_each`` (the name of an upstream task; it is a dependency even when
    ``depends_on`` omits it) is a map: it runs once per item of that task's JSON-list result,
    at most ``max_parallel`` items at once (None: no limit), each item with the task's retries,
    timeout and key templates, which may use ``{item}``, ``{index}`` and ``{item[field]}``.
    A task with ``wait_for_event`` has no handler either: it waits, holding no worker, for a
    matching event (whose data becomes its result) or its timeout.
    ``run_if`` (``domain/conditions.py``): ``all_done`` runs once every dependency finished
    whatever its outcome, ``any_failed`` only if one ended DEAD (else it is skipped).
    A task with ``workflow`` (a workflow's name) has no handler either: each attempt starts one
    child run of that workflow, with ``input`` (a JSON mapping whose strings may be templates
    over the run input and ``upstream``: ``domain/children.py``; None: the run's own input),
    and succeeds with the child's result or fails with its failure (its ``retry`` applies).
    ``queue`` (SPEC 7.4): the broker queue its messages (a map's: its items') go to; None: the
    ``broker.queue`` of the config that triggers the run (docs/flow-control.md).
    ``priority`` (SPEC 7.4): 0 (default) to 9, higher first within its queue; a trigger that
    names a priority overrides it for every task of its run (docs/flow-control.md "Priorities").
    """

    name: str
    handler: str = ""
    depends_on: tuple[str, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: float | None = None  # seconds; None means no per-task limit
    idempotency_key: str | None = None  # template over the run input
    ordering_key: str | None = None  # template over the run input
    on_dead: OnDead = OnDead.RELEASE
    sleep: float | None = None  # seconds: a durable timer (no handler)
    for_each: str | None = None  # a map over this upstream task's list result
    max_parallel: int | None = None  # a map's items running at once; None: no limit
    wait_for_event: EventWait | None = None  # waits for an event (no handler)
    run_if: RunIf = RunIf.ALL_SUCCEEDED
    workflow: str | None = None  # a child-workflow task: the workflow each attempt starts
    input: Mapping[str, Any] | None = field(default=None, hash=False)  # the child's input
    queue: str | None = None  # the queue its messages go to; None: the triggering config's
    concurrency: Concurrency | None = None  # at most limit READY/RUNNING per rendered key
    rate_limit: RateLimit | None = None  # at most limit starts per sliding window per key
    priority: int = 0  # 0..9, higher first within its queue
    circuit_breaker: CircuitBreaker | None = None  # its handler's breaker: domain/breakers.py

    def __post_init__(self) -> None:
        check_name(self.name, "task name")
        self._check_queue()
        self._check_priority()
        self._check_concurrency()
        self._check_rate_limit()
        if self.circuit_breaker is not None and not isinstance(
            self.circuit_breaker, CircuitBreaker
        ):
            raise DefinitionError(f"task {self.name!r}: circuit_breaker must be a CircuitBreaker")
        self._check_depends_on()
        self._check_map()
        if self.workflow is not None or self.input is not None:
            self._check_child()
        if not isinstance(self.run_if, RunIf):  # a string from Python code: its enum, or refused
            if not isinstance(self.run_if, str) or self.run_if not in {r.value for r in RunIf}:
                valid = ", ".join(r.value for r in RunIf)
                raise DefinitionError(f"task {self.name!r}: run_if must be one of {valid}")
            object.__setattr__(self, "run_if", RunIf(self.run_if))
        if self.run_if is not RunIf.ALL_SUCCEEDED and not self.depends_on and self.for_each is None:
            raise DefinitionError(
                f"task {self.name!r}: run_if: {self.run_if} needs depends_on (its condition "
                "is on the outcomes of its dependencies)"
            )
        self._check_kind()
        if self.timeout is not None and not 0 < self.timeout <= MAX_TIMEOUT_S:
            raise DefinitionError(
                f"task {self.name!r}: timeout must be a positive number of seconds "
                f"(at most {MAX_TIMEOUT_S:.0f})"
            )
        for label, template in (
            ("idempotency_key", self.idempotency_key),
            ("ordering_key", self.ordering_key),
        ):
            if template is not None:
                check_template(template, f"task {self.name!r}: {label}")
        if self.for_each is not None:
            self._check_item_keys()

    def _check_depends_on(self) -> None:
        """A tuple of names (a list from Python code becomes one; a lone string is refused:
        it would be read letter by letter, and a map's upstream would not be added to it)."""
        deps: Any = self.depends_on
        if isinstance(deps, list):
            deps = tuple(deps)
        if not isinstance(deps, tuple) or not all(isinstance(d, str) for d in deps):
            raise DefinitionError(
                f"task {self.name!r}: depends_on must be a list of task names, "
                f"not {type(self.depends_on).__name__}"
            )
        object.__setattr__(self, "depends_on", deps)

    def _check_kind(self) -> None:
        """A handler, or what takes its place: a timer, an event wait, a child workflow."""
        if self.workflow is not None:
            return  # _check_child did: no handler, nothing only an execution uses
        if self.sleep is not None:
            self._check_timer()
        elif self.wait_for_event is not None:
            self._check_wait()
        elif self.handler == "":
            raise DefinitionError(
                f"task {self.name!r}: needs a handler (or sleep: for a durable timer, "
                "wait_for_event: to wait for an event, workflow: to start a child run)"
            )
        else:
            check_name(self.handler, f"task {self.name!r}: handler")

    def _check_map(self) -> None:
        """``for_each`` names a task (made a dependency); ``max_parallel`` needs it."""
        label = f"task {self.name!r}"
        if self.for_each is None:
            if self.max_parallel is not None:
                raise DefinitionError(f"{label}: max_parallel is only for a for_each task")
            return
        check_name(self.for_each, f"{label}: for_each")
        if self.for_each == self.name:
            raise DefinitionError(f"{label}: for_each names the task itself")
        if self.sleep is not None:
            raise DefinitionError(f"{label}: a sleep task cannot have for_each")
        if self.wait_for_event is not None:  # nothing would wait per item: refused, not dropped
            raise DefinitionError(f"{label}: a wait_for_event task cannot have for_each")
        if self.max_parallel is not None and (
            isinstance(self.max_parallel, bool)
            or not isinstance(self.max_parallel, int)
            or not 1 <= self.max_parallel <= ITEMS_LIMIT
        ):
            raise DefinitionError(
                f"{label}: max_parallel must be a whole number from 1 to {ITEMS_LIMIT}"
            )
        if self.for_each not in self.depends_on:
            # the upstream of a map is one of its dependencies, listed or not
            object.__setattr__(self, "depends_on", (*self.depends_on, self.for_each))

    def _check_timer(self) -> None:
        """A durable timer has a sleep and nothing that only an execution would use."""
        label = f"task {self.name!r}"
        if isinstance(self.sleep, bool) or not isinstance(self.sleep, int | float):
            raise DefinitionError(f"{label}: sleep must be a number of seconds")
        if not 0 < self.sleep <= MAX_SPAN_S:  # NaN fails this too
            raise DefinitionError(
                f"{label}: sleep must be more than 0 and at most {MAX_SPAN_S:.0f} seconds"
            )
        if self.handler:
            raise DefinitionError(f"{label}: has both a handler and sleep: it is one or the other")
        if self.wait_for_event is not None:
            raise DefinitionError(
                f"{label}: has both sleep and wait_for_event: it is one or the other"
            )
        self._check_no_execution("a sleep task")

    def _check_wait(self) -> None:
        """A wait for an event has its event and nothing that only an execution would use."""
        label = f"task {self.name!r}"
        if not isinstance(self.wait_for_event, EventWait):
            raise DefinitionError(f"{label}: wait_for_event must be an EventWait")
        if self.handler:
            raise DefinitionError(
                f"{label}: has both a handler and wait_for_event: it is one or the other"
            )
        self._check_no_execution("a wait_for_event task")

    def _check_child(self) -> None:
        """A child-workflow task names a workflow, is nothing else, and its ``input`` is
        JSON whose templates read the run input or its own dependencies' results."""
        label = f"task {self.name!r}"
        if self.workflow is None:
            raise DefinitionError(f"{label}: input is only for a workflow: task (a child run)")
        check_name(self.workflow, f"{label}: workflow")
        for key, given in (
            ("handler", bool(self.handler)),
            ("for_each", self.for_each is not None),
            ("wait_for_event", self.wait_for_event is not None),
            ("sleep", self.sleep is not None),
        ):
            if given:
                raise DefinitionError(
                    f"{label}: has both workflow and {key}: a child-workflow task is neither "
                    "executed by a handler nor a map, a wait or a timer"
                )
        self._check_no_execution("a workflow task", allow_retry=True)
        if self.input is None:
            return
        if not isinstance(self.input, Mapping):
            raise DefinitionError(f"{label}: input must be a mapping (the child run's input)")
        try:
            to_json(self.input, f"{label}: input")
        except UnstorableValueError as exc:
            raise DefinitionError(str(exc)) from exc
        for text in children.template_strings(self.input):
            check_template(text, f"{label}: input")
        for text, name in children.template_fields(self.input):
            upstream = children.upstream_named(name)
            if upstream and upstream not in self.depends_on:  # '': every dependency's
                raise DefinitionError(
                    f"{label}: input {text!r} reads upstream[{upstream}], which is not one of "
                    f"its dependencies ({', '.join(self.depends_on) or 'none'})"
                )

    def _check_queue(self) -> None:
        """``queue`` is a name RabbitMQ accepts (:func:`~flowforge.domain.names.queue_problem`)."""
        if self.queue is None:
            return
        problem = queue_problem(self.queue)
        if problem is not None:
            raise DefinitionError(f"task {self.name!r}: queue {problem}")

    def _check_priority(self) -> None:
        """A whole number 0 to 9 (:func:`~flowforge.domain.names.priority_problem`)."""
        problem = priority_problem(self.priority)
        if problem is not None:
            raise DefinitionError(f"task {self.name!r}: priority {problem}")

    def _check_concurrency(self) -> None:
        """A :class:`Concurrency` (checked when built). On a map it applies to each item: the
        key is rendered per item (:meth:`key_templates`)."""
        if self.concurrency is None:
            return
        if not isinstance(self.concurrency, Concurrency):
            raise DefinitionError(f"task {self.name!r}: concurrency must be a Concurrency")

    def _check_rate_limit(self) -> None:
        """A :class:`RateLimit` (checked when built); on a map, per item, like ``concurrency``."""
        if self.rate_limit is None:
            return
        if not isinstance(self.rate_limit, RateLimit):
            raise DefinitionError(f"task {self.name!r}: rate_limit must be a RateLimit")

    def key_templates(self) -> tuple[tuple[str, str], ...]:
        """Its key templates that are rendered over the run input (a map's: per item, with
        ``item`` and ``index`` too), each with its label: ``idempotency_key``,
        ``ordering_key``, ``concurrency.key``, ``rate_limit.key``, ``circuit_breaker.key`` —
        those it sets."""
        found = (
            ("idempotency_key", self.idempotency_key),
            ("ordering_key", self.ordering_key),
            ("concurrency.key", self.concurrency.key if self.concurrency else None),
            ("rate_limit.key", self.rate_limit.key if self.rate_limit else None),
            ("circuit_breaker.key", self.circuit_breaker.key if self.circuit_breaker else None),
        )
        return tuple((label, t) for label, t in found if isinstance(t, str))

    def _check_item_keys(self) -> None:
        """A map's key templates may read ``index``, the item's position, only whole: a number
        has no fields, so ``{index[0]}`` could render for no item at all."""
        for label, template in self.key_templates():
            for name in template_fields(template):
                if name.startswith("index["):
                    raise DefinitionError(
                        f"task {self.name!r}: {label}: {{{name}}}: index is the item's position "
                        "(a whole number) and has no fields; use {index} or {item[...]}"
                    )

    def _check_no_execution(self, kind: str, allow_retry: bool = False) -> None:
        """Refuse what only an execution would use on a task that never executes (a child
        task's attempts are child runs: its ``retry`` applies to them)."""
        label = f"task {self.name!r}"
        extras = {
            "timeout": self.timeout is not None,
            "idempotency_key": self.idempotency_key is not None,
            "ordering_key": self.ordering_key is not None,
            "retry": self.retry != RetryPolicy() and not allow_retry,
            "on_dead": self.on_dead is not OnDead.RELEASE,
            "queue": self.queue is not None,
            "concurrency": self.concurrency is not None,
            "rate_limit": self.rate_limit is not None,
            "priority": self.priority != 0,
            "circuit_breaker": self.circuit_breaker is not None,
        }
        for key, given in extras.items():
            if given:
                raise DefinitionError(f"{label}: {kind} takes no {key} (it never executes)")


@dataclass(frozen=True)
class WorkflowDef:
    """A named DAG of tasks. ``fail_fast``: a dead task cancels the rest of its run.

    ``deadline`` (seconds): a run still unfinished that long after it was created (or, for a
    delayed run, after its start time) ends FAILED with reason ``deadline_exceeded``.
    ``schedules`` start runs by themselves (``flowforge/domain/schedule.py``); they are not
    part of :meth:`to_dict` nor of the digest: changing a schedule is no new version."""

    name: str
    tasks: tuple[TaskDef, ...]
    fail_fast: bool = True
    deadline: float | None = None
    schedules: tuple[ScheduleDef, ...] = ()
    max_items: int | None = None  # a map's most items; None: DEFAULT_MAX_ITEMS

    def __post_init__(self) -> None:
        check_name(self.name, "workflow name")
        if self.deadline is not None and (
            isinstance(self.deadline, bool)
            or not isinstance(self.deadline, int | float)
            or not 0 < self.deadline <= MAX_SPAN_S
        ):
            raise DefinitionError(
                f"workflow {self.name!r}: deadline must be more than 0 and at most "
                f"{MAX_SPAN_S:.0f} seconds"
            )
        if not self.tasks:
            raise DefinitionError(f"workflow {self.name!r}: has no tasks")
        seen: set[str] = set()
        for task in self.tasks:
            if task.name in seen:
                raise DefinitionError(f"workflow {self.name!r}: duplicate task name {task.name!r}")
            seen.add(task.name)
        self._check_maps(seen)
        for task in self.tasks:
            if task.workflow == self.name:
                raise DefinitionError(
                    f"workflow {self.name!r}: task {task.name!r} starts workflow {self.name!r} "
                    "itself: a workflow cannot recurse into itself"
                )
            if len(set(task.depends_on)) != len(task.depends_on):
                raise DefinitionError(
                    f"workflow {self.name!r}: task {task.name!r} lists a dependency twice"
                )
            for dep in task.depends_on:
                if dep not in seen:
                    raise DefinitionError(
                        f"workflow {self.name!r}: task {task.name!r} depends on unknown task "
                        f"{dep!r}"
                    )
        self._check_cycle()
        self._check_schedules()

    def _check_maps(self, names: set[str]) -> None:
        """``max_items`` in range; each ``for_each`` names a task of the workflow."""
        if self.max_items is not None and (
            isinstance(self.max_items, bool)
            or not isinstance(self.max_items, int)
            or not 1 <= self.max_items <= ITEMS_LIMIT
        ):
            raise DefinitionError(
                f"workflow {self.name!r}: max_items must be a whole number from 1 to {ITEMS_LIMIT}"
            )
        for task in self.tasks:
            if task.for_each is not None and task.for_each not in names:
                raise DefinitionError(
                    f"workflow {self.name!r}: task {task.name!r}: for_each names unknown task "
                    f"{task.for_each!r} (it must be a task upstream of it)"
                )

    def _check_cycle(self) -> None:
        """No dependency cycle; one that ``for_each`` closes (naming a task downstream of the
        map) is reported as such."""
        cycle = find_cycle({t.name: t.depends_on for t in self.tasks})
        if not cycle:
            return
        mapped = [t for t in self.tasks if t.for_each in cycle and t.name in cycle]
        if mapped:
            raise DefinitionError(
                f"workflow {self.name!r}: task {mapped[0].name!r}: for_each names "
                f"{mapped[0].for_each!r}, which is not upstream of it (cycle "
                f"{' -> '.join(cycle)})"
            )
        raise DefinitionError(f"workflow {self.name!r}: dependency cycle {' -> '.join(cycle)}")

    def _check_schedules(self) -> None:
        """Distinct schedule names, and each schedule's input renders every key template (a
        scheduled run must never fail to plan)."""
        named: set[str] = set()
        for index, schedule in enumerate(self.schedules):
            if not isinstance(schedule, ScheduleDef):
                raise ScheduleError(f"schedules[{index}]", "must be a ScheduleDef")
            name = schedule.name or default_name(self.name, index)
            if name in named:
                raise ScheduleError(
                    f"schedules[{index}].name", f"schedule name {name!r} is used twice"
                )
            named.add(name)
            for task in self.tasks:
                # a map's templates are rendered per item, at expansion: what they read of the
                # run input is checked here all the same
                render = render_key if task.for_each is None else check_item_key
                templates = task.key_templates()
                if task.wait_for_event is not None:
                    templates += (("wait_for_event.key", task.wait_for_event.key),)
                for label, template in templates:
                    where = f"task {task.name!r}: {label}"
                    try:
                        rendered = render(template, schedule.input, where)
                        if label == "circuit_breaker.key" and task.for_each is None:
                            check_breaker_key(rendered, where)  # '' is the handler's breaker
                    except InputError as exc:
                        raise ScheduleError(f"schedules[{index}].input", str(exc)) from None

    def named_schedules(self) -> tuple[tuple[str, ScheduleDef], ...]:
        """Each schedule with its name: its ``name``, else ``workflow/index``."""
        return tuple(
            (s.name or default_name(self.name, i), s) for i, s in enumerate(self.schedules)
        )

    def task(self, name: str) -> TaskDef:
        """The task called ``name``; KeyError if there is none."""
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)

    def topological_order(self) -> tuple[TaskDef, ...]:
        """Tasks so that each comes after its dependencies; ties keep declaration order."""
        placed: set[str] = set()
        order: list[TaskDef] = []
        remaining = list(self.tasks)
        while remaining:
            ready = [t for t in remaining if all(d in placed for d in t.depends_on)]
            order.extend(ready)
            placed.update(t.name for t in ready)
            remaining = [t for t in remaining if t.name not in placed]
        return tuple(order)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready canonical form (the inverse of the YAML/mapping parser).

        Keys added after the first release (``deadline``, ``max_items``, a task's ``sleep``,
        ``for_each``, ``max_parallel``, ``wait_for_event``, ``run_if``, ``queue``, ``concurrency``,
        ``rate_limit``, ``priority``) appear only when set, so the digests of definitions that do
        not use them never change.
        """
        data: dict[str, Any] = {
            "name": self.name,
            "fail_fast": self.fail_fast,
            "tasks": [_task_to_dict(t) for t in self.tasks],
        }
        if self.deadline is not None:
            data["deadline"] = float(self.deadline)
        if self.max_items is not None:
            data["max_items"] = self.max_items
        return data

    @functools.cached_property
    def digest(self) -> str:
        """A stable hash of the canonical form: equal definitions have equal digests (computed
        once per definition: a trigger reads it for every run it creates)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _task_to_dict(task: TaskDef) -> dict[str, Any]:
    data = _task_keys(task)
    if task.run_if is not RunIf.ALL_SUCCEEDED:  # only when set: existing digests stay
        data["run_if"] = str(task.run_if)
    if task.queue is not None:  # the same
        data["queue"] = task.queue
    if task.concurrency is not None:  # the same
        data["concurrency"] = {"key": task.concurrency.key, "limit": task.concurrency.limit}
    if task.rate_limit is not None:  # the same
        rate: dict[str, Any] = {"limit": task.rate_limit.limit, "per": float(task.rate_limit.per)}
        if task.rate_limit.key is not None:
            rate["key"] = task.rate_limit.key
        data["rate_limit"] = rate
    if task.priority:  # the same: only when not the default 0
        data["priority"] = task.priority
    if task.circuit_breaker is not None:  # the same
        data["circuit_breaker"] = task.circuit_breaker.to_dict()
    return data


def _task_keys(task: TaskDef) -> dict[str, Any]:
    if task.sleep is not None:  # a timer: none of an execution's keys
        return {"name": task.name, "depends_on": list(task.depends_on), "sleep": float(task.sleep)}
    if task.wait_for_event is not None:  # a wait: none of an execution's keys either
        wait = task.wait_for_event
        return {
            "name": task.name,
            "depends_on": list(task.depends_on),
            "wait_for_event": {"name": wait.name, "key": wait.key, "timeout": float(wait.timeout)},
        }
    if task.workflow is not None:  # a child run per attempt: its retry applies, nothing else
        child: dict[str, Any] = {
            "name": task.name,
            "depends_on": list(task.depends_on),
            "workflow": task.workflow,
            "retry": _retry_dict(task.retry),
        }
        if task.input is not None:
            child["input"] = task.input
        return child
    data: dict[str, Any] = {
        "name": task.name,
        "handler": task.handler,
        "depends_on": list(task.depends_on),
        "retry": _retry_dict(task.retry),
        "timeout": None if task.timeout is None else float(task.timeout),
        "idempotency_key": task.idempotency_key,
        "ordering_key": task.ordering_key,
        "on_dead": str(task.on_dead),
    }
    if task.for_each is not None:
        data["for_each"] = task.for_each
        if task.max_parallel is not None:
            data["max_parallel"] = task.max_parallel
    return data


def _retry_dict(retry: RetryPolicy) -> dict[str, Any]:
    return {
        "max_attempts": retry.max_attempts,
        "base_delay": float(retry.base_delay),
        "max_delay": float(retry.max_delay),
        "jitter": str(retry.jitter),
    }


def find_cycle(edges: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A dependency cycle as a path that ends where it starts, or None if the graph is a DAG."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(edges, white)
    for root in edges:
        if colour[root] != white:
            continue
        path = [root]
        stack = [iter(edges[root])]
        colour[root] = grey
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = black
                stack.pop()
            elif colour.get(nxt, black) == grey:
                return [*path[path.index(nxt) :], nxt]
            elif colour.get(nxt, black) == white:
                colour[nxt] = grey
                path.append(nxt)
                stack.append(iter(edges[nxt]))
    return None
