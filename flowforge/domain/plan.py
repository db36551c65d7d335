"""Planning the rows of new runs: pure, so a batch of triggers becomes a few array inserts.

A plan holds, column by column, every run, task run and edge to insert — validated inputs,
rendered key templates, request digests for trigger idempotency — before any SQL runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID

from flowforge.domain import ids, timing
from flowforge.domain.breakers import check_breaker_key
from flowforge.domain.conditions import is_conditional
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.keys import check_item_key, render_key
from flowforge.domain.names import priority_problem
from flowforge.domain.values import JsonText, check_text, to_json
from flowforge.errors import InputError


@dataclass(slots=True)  # not frozen: a frozen init costs ~9x, felt in a 10,000-task fan-out
class PlannedTask:
    """One task run to insert: PENDING on ``pending`` unmet dependencies (READY at none).

    ``start_gate``: a root task of a delayed run, whose ``pending`` counts one more "dependency"
    (the run's start time) that a scheduler's ``start_due_runs`` removes. ``sleep_s``: a
    durable timer (no handler, never READY, never dispatched). ``for_each``: a map task (the
    upstream task it maps over; never READY itself: a scheduler pass expands it into items,
    ``max_parallel`` of them running at once), whose key templates are rendered per item.
    ``event_name``, ``event_key`` (rendered from the run input) and ``event_timeout_s``: a wait
    for an event (no handler, never READY, never dispatched either). ``child_workflow``: a
    child-workflow task (never READY either: a scheduler pass starts its child runs).
    ``run_if``: a conditional task
    (not ``all_succeeded``) counts one more "dependency" in ``pending``, its condition gate,
    which only the scheduler's ``evaluate_conditions`` opens (or it skips the task).
    ``queue``: the broker queue its messages go to (its workflow's, else the trigger's default;
    None: unassigned, see :func:`plan_runs`). ``priority``: 0 to 9, higher first within its
    queue (the trigger's, else its workflow's).
    """

    run_id: UUID
    id: UUID
    name: str
    handler: str
    pending: int
    max_attempts: int
    base_delay_s: float
    max_delay_s: float
    jitter: str
    timeout_s: float | None
    idempotency_key: str | None
    ordering_key: str | None
    on_dead: str
    start_gate: bool = False
    sleep_s: float | None = None
    for_each: str | None = None
    max_parallel: int | None = None
    event_name: str | None = None
    event_key: str | None = None
    event_timeout_s: float | None = None
    run_if: str = "all_succeeded"
    child_workflow: str | None = None
    queue: str | None = None
    concurrency_key: str | None = None  # rendered; None: no concurrency limit
    concurrency_limit: int | None = None
    rate_key: str | None = None  # rendered (the handler's name when none given); None: no limit
    rate_limit: int | None = None
    rate_per_s: float | None = None
    priority: int = 0
    breaker_failures: int | None = None  # circuit_breaker's thresholds; None: none declared
    breaker_window_s: float | None = None
    breaker_cooldown_s: float | None = None
    breaker_key: str | None = None  # circuit_breaker.key rendered; None: the handler's breaker

    def created_ready(self, admitted: bool = False) -> bool:
        """Whether the trigger's insert creates this task READY (else PENDING): nothing to wait
        for (no dependency, no closed start gate, no ordering key) and either ``admitted``
        through its concurrency and rate keys or none of the kinds that never start by
        themselves (a timer, a map, an event wait, a child workflow, a limited task). The same
        decision as queries.sql ``new_tasks``' ``k.ready`` (task_runs.ready_by_itself's
        expression); tests/integration/test_trigger_wakes.py checks the two agree for every
        kind of task."""
        return (
            self.pending == 0
            and self.ordering_key is None
            and (
                admitted
                or (
                    self.sleep_s is None
                    and self.for_each is None
                    and self.event_name is None
                    and self.child_workflow is None
                    and self.concurrency_key is None
                    and self.rate_key is None
                )
            )
        )


@dataclass
class RunPlan:
    """The runs (column by column), their task runs and their dependency edges to insert.

    Every run of one plan shares its timing: a start time (``start_at``, an aware datetime) or
    a delay in seconds (``delay_s``, added to the database's now), and a deadline in seconds
    (``deadline_s``; None: the workflow's own, if any).
    """

    start_at: datetime | None = None
    delay_s: float | None = None
    deadline_s: float | None = None
    run_ids: list[UUID] = field(default_factory=list)
    inputs: list[JsonText] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    digests: list[str | None] = field(default_factory=list)
    tasks: list[PlannedTask] = field(default_factory=list)
    upstream: list[UUID] = field(default_factory=list)
    downstream: list[UUID] = field(default_factory=list)
    upstream_names: list[str] = field(default_factory=list)  # each edge's upstream task's name
    # a child run (sub-workflows): the task and attempt that start it, its nesting depth
    parent_run_id: UUID | None = None
    parent_task_id: UUID | None = None
    parent_attempt: int | None = None
    depth: int = 0
    # the priority the runs were triggered with (None: each task its own); child runs inherit it
    priority: int | None = None
    # each run's place in the caller's batch, for messages (None: its index among the inputs)
    positions: list[int] | None = None

    def where(self, index: int, total: int | None = None) -> str:
        """How a message names the run at ``index`` of ``total`` (None: of the runs planned):
        ``runs[N]: `` in a batch (``positions``), ``input N: `` among several inputs, nothing
        for a single run."""
        if self.positions is not None:
            return f"runs[{self.positions[index]}]: "
        return f"input {index}: " if (total or len(self.run_ids)) > 1 else ""

    @property
    def delayed(self) -> bool:
        """Whether the runs wait for a start time (they are created SCHEDULED)."""
        return self.start_at is not None or self.delay_s is not None

    def ordering_keys(self) -> list[str]:
        return sorted({t.ordering_key for t in self.tasks if t.ordering_key is not None})

    def tasks_of(self, runs: set[UUID]) -> list[PlannedTask]:
        """The task runs of ``runs`` (the runs actually inserted)."""
        if len(runs) == len(self.run_ids):
            return self.tasks
        return [t for t in self.tasks if t.run_id in runs]

    def edges_of(self, tasks: set[UUID]) -> Edges:
        """The dependency edges into ``tasks``, column by column (``insert_edges``' parameters)."""
        edges = zip(self.upstream, self.downstream, self.upstream_names, strict=True)
        kept = [edge for edge in edges if edge[1] in tasks]
        return Edges([u for u, _, _ in kept], [d for _, d, _ in kept], [n for _, _, n in kept])


class Edges(NamedTuple):
    """Dependency edges, column by column: the upstream task's id and name, the downstream's id
    (the name is stored with the edge so a join pages its upstream tasks on the edges' index)."""

    upstream: list[UUID]
    downstream: list[UUID]
    names: list[str]


def request_digest(workflow: str, stored: JsonText) -> str:
    """What a trigger idempotency key stands for: the workflow and the input, as stored.

    Keys are sorted so that the order an input was written in does not matter; read back from
    its stored text, every key is a string, so keys of mixed types (``{0: 1, "a": 2}``) sort.
    """
    canonical = json.dumps({"workflow": workflow, "input": json.loads(stored)}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def plan_runs(
    workflow: WorkflowDef,
    inputs: Sequence[Mapping[str, Any] | None],
    keys: Sequence[str | None] | None = None,
    *,
    start_at: Any = None,
    delay: Any = None,
    deadline: Any = None,
    queue: str | None = None,
    priority: int | None = None,
    positions: Sequence[int] | None = None,
) -> RunPlan:
    """Rows for one run of ``workflow`` per input; :class:`InputError` names the bad one
    (``input N``, or with ``positions`` — each input's place in a batch of several workflows,
    :func:`group_requests` — ``runs[N]``).

    ``queue`` is the default of every task that names none (the triggering config's
    ``broker.queue``); None leaves those unassigned: the publisher that takes their messages
    sends them to its own ``broker.queue``, as before queues routed (migration 0014).
    ``priority`` (0 to 9) replaces every task's own priority (None: each keeps its own).

    ``start_at`` (an aware datetime) or ``delay`` (seconds or a timedelta) makes the runs
    delayed: their root tasks carry a closed start gate. ``deadline`` (seconds or a timedelta)
    overrides the workflow's. Whether ``start_at`` is in the past is the store's to judge, on
    the database clock (:func:`~flowforge.domain.timing.judge_start_at`).
    """
    keys = [None] * len(inputs) if keys is None else list(keys)
    if len(keys) != len(inputs):
        raise InputError("one idempotency key (or None) is needed per input")
    begin, delay_s = timing.start(start_at, delay)
    _check_priority(priority)
    plan = RunPlan(
        start_at=begin,
        delay_s=delay_s,
        deadline_s=None if deadline is None else timing.seconds(deadline, "deadline"),
        priority=priority,
        positions=None if positions is None else list(positions),
    )
    gated = plan.delayed
    ordered = workflow.topological_order()
    for index, (raw, key) in enumerate(zip(inputs, keys, strict=True)):
        run_input = {} if raw is None else raw
        where = plan.where(index, len(inputs))
        if not isinstance(run_input, Mapping):
            raise InputError(where + "the run input must be a JSON object")
        stored = to_json(run_input, f"{where}the run input")
        if key is not None:
            key = check_text(key, f"{where}the idempotency key")
        run_id = ids.new_id()
        plan.run_ids.append(run_id)
        plan.inputs.append(stored)
        plan.keys.append(key)
        # only a key is compared with a digest: without one, the input is not parsed, dumped
        # and hashed once more (a third of a 100 KB trigger's Python; docs/performance.md)
        plan.digests.append(None if key is None else request_digest(workflow.name, stored))
        task_ids = {t.name: ids.new_id() for t in ordered}
        for task in ordered:
            label = f"{where}task {task.name!r}"
            breaker = task.circuit_breaker
            planned = PlannedTask(
                run_id=run_id,
                id=task_ids[task.name],
                name=task.name,
                handler=task.handler,
                pending=len(task.depends_on),
                max_attempts=task.retry.max_attempts,
                base_delay_s=task.retry.base_delay,
                max_delay_s=task.retry.max_delay,
                jitter=str(task.retry.jitter),
                timeout_s=task.timeout,
                idempotency_key=None
                if task.for_each is not None  # rendered per item, at expansion
                else _render(task.idempotency_key, run_input, f"{label} idempotency_key"),
                ordering_key=None
                if task.for_each is not None
                else _render(task.ordering_key, run_input, f"{label} ordering_key"),
                on_dead=str(task.on_dead),
                sleep_s=task.sleep,
                for_each=task.for_each,
                max_parallel=task.max_parallel,
                run_if=str(task.run_if),
                child_workflow=task.workflow,
                queue=task.queue or queue,
                priority=task.priority if priority is None else priority,
                breaker_failures=None if breaker is None else breaker.failures,
                breaker_window_s=None if breaker is None else breaker.window,
                breaker_cooldown_s=None if breaker is None else breaker.cooldown,
                breaker_key=_breaker_key(task, run_input, label),
            )
            _limit(planned, task, run_input, label)
            if task.wait_for_event is not None:
                wait = task.wait_for_event
                planned.event_name = wait.name
                planned.event_key = _render(wait.key, run_input, f"{label} wait_for_event.key")
                planned.event_timeout_s = float(wait.timeout)
            if is_conditional(task.run_if):
                planned.pending += 1  # the condition gate (a conditional task is never a root)
            if gated and not task.depends_on:
                planned.pending += 1
                planned.start_gate = True
            plan.tasks.append(planned)
            for dep in task.depends_on:
                plan.upstream.append(task_ids[dep])
                plan.downstream.append(task_ids[task.name])
                plan.upstream_names.append(dep)
    return plan


def _render(template: str | None, run_input: Mapping[str, Any], label: str) -> str | None:
    """A task's key from its template; refused if PostgreSQL could not store or index it."""
    if template is None:
        return None
    return check_text(render_key(template, run_input, label), label)


def _limit(planned: PlannedTask, task: TaskDef, run_input: Mapping[str, Any], label: str) -> None:
    """The task's concurrency and rate keys rendered, with their limits. Not a map's: its items
    carry them, rendered at expansion (domain/maps.py); what its key templates read of the run
    input is checked here all the same, as it is the same for every item."""
    if task.for_each is not None:
        for key, template in task.key_templates():
            check_item_key(template, run_input, f"{label} {key}")
        return
    planned.concurrency_key = _concurrency_key(task, run_input, label)
    if task.concurrency is not None:
        planned.concurrency_limit = task.concurrency.limit
    planned.rate_key = _rate_key(task, run_input, label)
    if task.rate_limit is not None:
        planned.rate_limit = task.rate_limit.limit
        planned.rate_per_s = float(task.rate_limit.per)


def _concurrency_key(task: TaskDef, run_input: Mapping[str, Any], label: str) -> str | None:
    """The task's concurrency key rendered over the run input (None: no limit)."""
    if task.concurrency is None:
        return None
    return _render(task.concurrency.key, run_input, f"{label} concurrency.key")


def _rate_key(task: TaskDef, run_input: Mapping[str, Any], label: str) -> str | None:
    """The task's rate key rendered over the run input; its handler's name when the rate limit
    names no key (None: no rate limit)."""
    if task.rate_limit is None:
        return None
    if task.rate_limit.key is None:
        return task.handler
    return _render(task.rate_limit.key, run_input, f"{label} rate_limit.key")


def _breaker_key(task: TaskDef, run_input: Mapping[str, Any], label: str) -> str | None:
    """The task's breaker key rendered over the run input (None: no key, the handler's breaker;
    a map's items render theirs at expansion, domain/maps.py); never '' (the handler's)."""
    breaker = task.circuit_breaker
    if breaker is None or breaker.key is None or task.for_each is not None:
        return None
    where = f"{label} circuit_breaker.key"
    return check_breaker_key(render_key(breaker.key, run_input, where), where)


def _check_priority(priority: int | None) -> None:
    """A trigger's priority: None, or a whole number 0 to 9 (:class:`InputError` if not)."""
    problem = None if priority is None else priority_problem(priority)
    if problem is not None:
        raise InputError(f"priority {problem}")


@dataclass(frozen=True)
class RunRequest:
    """One run of a batch (:meth:`Client.trigger_batch`, ``POST /api/v1/runs:batch``): the
    arguments of :meth:`Client.trigger` for it."""

    workflow: str
    input: Mapping[str, Any] | None = None
    idempotency_key: str | None = None
    start_at: Any = None
    delay: Any = None
    deadline: Any = None
    priority: int | None = None

    def group(self) -> tuple[Any, ...]:
        """What runs planned together share: the workflow, the timing and the priority."""
        return (self.workflow, self.start_at, self.delay, self.deadline, self.priority)


def group_requests(requests: Sequence[RunRequest]) -> list[list[int]]:
    """The positions of ``requests``, grouped by :meth:`RunRequest.group` (each group is one
    plan), groups in the order of their first request; :class:`InputError` names a request
    whose timing or priority is not a value (a list, say)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for position, request in enumerate(requests):
        try:
            groups.setdefault(request.group(), []).append(position)
        except TypeError:
            raise InputError(
                f"runs[{position}]: start_at, delay, deadline and priority must be single values"
            ) from None
    return list(groups.values())
