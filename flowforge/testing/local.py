"""Running a workflow's handlers in-process, without PostgreSQL or RabbitMQ, to test them.

:class:`LocalRunner` executes one run at a time in the calling thread: its tasks one after
another in dependency order (declaration order among those ready together), each through the
worker's own steps where they can be followed without services — the run input checked and
its keys rendered as a trigger does (``domain/plan.py``), the handler's outcome judged by the
worker's ``classify`` (the same JSON checks and size bound), failures routed by the
scheduler's retry policy (``domain/policy.py``), conditions by ``domain/conditions.py``, maps
by ``domain/maps.py``, the run state by ``domain/runstate.py``. What it does not emulate, and
why: docs/testing-workflows.md, "What the local runner does not do".
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any
from uuid import UUID, uuid4

from flowforge.config import Config, WorkerConfig, load_config
from flowforge.domain import conditions, policy
from flowforge.domain.children import MAX_CHILD_DEPTH, render_input
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.maps import MapFailure, item_name, plan_items
from flowforge.domain.model import Finish
from flowforge.domain.plan import plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.domain.runstate import RunFacts, derive
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.domain.values import to_json
from flowforge.errors import InputError
from flowforge.roles.asyncrun import AsyncRunner
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import Job, classify
from flowforge.roles.upstream import InMemoryUpstream, bounded
from flowforge.testing.results import REUSED, LocalAttempt, LocalRun, LocalTask
from flowforge.testing.sources import Handler, WorkflowSource, load_handlers, load_workflows


class LocalRunner:
    """Runs workflows in-process with the given handlers (see the module docstring).

    ``workflows``: :class:`~flowforge.WorkflowDef` objects, or YAML files or folders of them.
    ``handlers``: module names (imported as a worker imports ``handlers:``, from
    ``search_path`` first), modules, or a mapping of handler name to function — later ones
    win, so a mapping after the modules replaces single handlers with stand-ins.
    ``sleep``: called with each retry's backoff in seconds (None, the default: no waiting,
    the backoff is only recorded on the attempt). ``rand``: the jitter's randomness, a
    function returning a float in [0, 1). ``max_result_bytes``: ``worker.max_result_bytes``.
    ``upstream_inline_items``, ``upstream_page_items``: the worker's: past them a handler's
    ``ctx.upstream`` holds the same paged views a worker's does (docs/handlers.md "Large
    upstream results"), read from memory.

    Idempotency keys that SUCCEEDED are kept for the runner's life, as the database keeps
    them: a later task (of any run of this runner) with the same rendered key reuses the
    result without calling its handler (:meth:`forget_keys` clears them).
    """

    def __init__(
        self,
        workflows: WorkflowSource | Iterable[WorkflowSource] = (),
        handlers: Mapping[str, Handler] | Iterable[str | ModuleType | Mapping[str, Handler]] = (),
        *,
        search_path: str | Path | None = None,
        sleep: Callable[[float], None] | None = None,
        rand: Callable[[], float] = random.random,
        max_result_bytes: int = WorkerConfig.max_result_bytes,
        clock: Callable[[], float] = time.monotonic,
        upstream_inline_items: int = WorkerConfig.upstream_inline_items,
        upstream_page_items: int = WorkerConfig.upstream_page_items,
    ) -> None:
        self.workflows = load_workflows(workflows)
        self.handlers = load_handlers(handlers, search_path)
        self._sleep = sleep
        self._rand = rand
        self._max_result_bytes = max_result_bytes
        self._clock = clock
        # ctx.upstream bounded as a worker's claim bounds it (issue 22): the same views
        WorkerConfig(
            upstream_inline_items=upstream_inline_items, upstream_page_items=upstream_page_items
        )  # (validated as the config file's are: a ValueError)
        self._upstream_bounds = (upstream_inline_items, upstream_page_items)
        self._loop: AsyncRunner | None = None  # async def handlers' event loop, when one runs
        self._keys: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: Config | str | Path, **options: Any) -> LocalRunner:
        """A runner with a config's ``workflows`` and ``handlers`` (imported from its
        folder, as a worker does) and its ``worker.max_result_bytes``. Nothing is connected
        to: the database and broker settings are not used."""
        if not isinstance(config, Config):
            config = load_config(config)
        options.setdefault("max_result_bytes", config.worker.max_result_bytes)
        options.setdefault("upstream_inline_items", config.worker.upstream_inline_items)
        options.setdefault("upstream_page_items", config.worker.upstream_page_items)
        return cls(
            config.workflow_paths(),
            config.handlers,
            search_path=config.base_dir,
            **options,
        )

    def forget_keys(self) -> None:
        """Forget every idempotency key that SUCCEEDED (a fresh database, as it were)."""
        self._keys.clear()

    def run(
        self,
        workflow: str | WorkflowDef,
        input: Mapping[str, Any] | None = None,
        *,
        upstream: Mapping[str, Any] | None = None,
        events: Mapping[str | tuple[str, str], Any] | None = None,
    ) -> LocalRun:
        """Run ``workflow`` (a name of this runner's workflows, or a definition) with
        ``input`` to the end and return what happened.

        ``upstream``: results for tasks that are not run but taken as SUCCEEDED with that
        result (a task downstream of a slow or external step, an event wait, a child run).
        ``events``: the data of events that arrive for ``wait_for_event`` tasks, by event
        name, or by ``(name, key)`` for one rendered key; a wait with no event given ends as
        its timeout would, DEAD ``event_timeout``. A bad input, or an ``upstream`` naming no
        task of the workflow, or holding what PostgreSQL could not store, raises
        :class:`~flowforge.errors.InputError` before any handler runs.
        """
        definition = workflow if isinstance(workflow, WorkflowDef) else self._workflow(workflow)
        return _Execution(self, definition, events or {}).run(input, upstream or {})

    def _event_loop(self) -> AsyncRunner:
        """The event loop ``async def`` handlers run on (one call at a time: tasks run one
        after another here), started with the first of them."""
        if self._loop is None:
            self._loop = AsyncRunner(1)
        return self._loop

    def _workflow(self, name: str) -> WorkflowDef:
        found = self.workflows.get(name)
        if found is None:
            known = ", ".join(sorted(self.workflows)) or "none"
            raise InputError(f"unknown workflow {name!r} (this runner has: {known})")
        return found


class _Execution:
    """One run of one workflow: its tasks' records, filled in dependency order."""

    def __init__(
        self,
        runner: LocalRunner,
        definition: WorkflowDef,
        events: Mapping[str | tuple[str, str], Any],
        depth: int = 0,
    ) -> None:
        self.runner = runner
        self.definition = definition
        self.events = events
        self.depth = depth
        self.run_id = uuid4()
        self.tasks: dict[str, LocalTask] = {}
        self.input: Mapping[str, Any] = {}
        self.keys: dict[str, str | None] = {}
        self.event_keys: dict[str, str | None] = {}

    def run(self, run_input: Mapping[str, Any] | None, upstream: Mapping[str, Any]) -> LocalRun:
        plan = plan_runs(self.definition, [run_input])  # the trigger's checks: InputError
        self.input = json.loads(plan.inputs[0])  # what a worker reads back
        self.keys = {t.name: t.idempotency_key for t in plan.tasks}
        self.event_keys = {t.name: t.event_key for t in plan.tasks}
        self._take_given(upstream)
        for task in self.definition.topological_order():
            if task.name not in self.tasks:
                self._decide(task)
        counts: dict[TaskState, int] = {}
        for record in self.tasks.values():
            counts[record.state] = counts.get(record.state, 0) + 1
        facts = RunFacts(
            counts=counts,
            any_attempted=any(t.attempts for t in self.tasks.values()),
            skipped=sum(1 for t in self.tasks.values() if t.skipped),
        )
        ordered = {t.name: self.tasks[t.name] for t in self.definition.tasks}
        return LocalRun(self.definition.name, self.input, derive(facts), ordered)

    def _take_given(self, upstream: Mapping[str, Any]) -> None:
        names = {t.name for t in self.definition.tasks}
        for name, result in upstream.items():
            if name not in names:
                raise InputError(
                    f"upstream: {name!r} is not a task of {self.definition.name!r} "
                    f"({', '.join(sorted(names))})"
                )
            value = _read_back(to_json(result, f"upstream[{name!r}]"))
            self.tasks[name] = LocalTask(name, TaskState.SUCCEEDED, result=value, given=True)

    def _decide(self, task: TaskDef) -> None:
        """Run the task if its dependencies let it, else cancel or skip it."""
        cause = self._blocked(task)
        if cause is not None:
            self._set(LocalTask(task.name, TaskState.CANCELLED, run_if=task.run_if), cause)
            return
        record = self._start(task)
        record.run_if = task.run_if
        self._set(record)

    def _blocked(self, task: TaskDef) -> CancelCause | None:
        """None when the task may run; why it cannot otherwise (docs/dynamic.md,
        "Conditions and compensation": a skip is ``condition_not_met``)."""
        deps = [self.tasks[d] for d in task.depends_on]
        if conditions.is_conditional(task.run_if):
            verdict = conditions.decide(task.run_if, [d.state for d in deps])
            return None if verdict is conditions.Verdict.RUN else CancelCause.CONDITION_NOT_MET
        bad = [d for d in deps if d.state is not TaskState.SUCCEEDED]
        if not bad:
            return None
        if all(d.skipped for d in bad):
            return CancelCause.CONDITION_NOT_MET
        return CancelCause.UPSTREAM

    def _start(self, task: TaskDef) -> LocalTask:
        if task.sleep is not None:  # a durable timer: no time passes here
            return LocalTask(task.name, TaskState.SUCCEEDED)
        if task.wait_for_event is not None:
            return self._event(task)
        if task.workflow is not None:
            return self._child(task)
        if task.for_each is not None:
            return self._map(task)
        return self._execute(task, task.name, self._upstream(task), self.keys.get(task.name))

    def _set(self, record: LocalTask, cause: CancelCause | None = None) -> None:
        if cause is not None:
            record.cancel_cause = cause
            record.failure_reason = FailureReason.CANCELLED
        self.tasks[record.name] = record
        if record.state is TaskState.DEAD and self.definition.fail_fast:
            self._fail_fast()

    def _fail_fast(self) -> None:
        """Cancel every task not decided yet (cause ``upstream``) but the conditional ones
        and what is downstream of them: a compensation waits for the failure that set it
        off (``cancel_not_started`` in queries.sql)."""
        pending = [t for t in self.definition.tasks if t.name not in self.tasks]
        spared = {t.name for t in pending if conditions.is_conditional(t.run_if)}
        grew = True
        while grew:
            more = {t.name for t in pending if spared.intersection(t.depends_on)} - spared
            spared |= more
            grew = bool(more)
        for task in pending:
            if task.name not in spared:
                record = LocalTask(task.name, TaskState.CANCELLED, run_if=task.run_if)
                record.cancel_cause = CancelCause.UPSTREAM
                record.failure_reason = FailureReason.CANCELLED
                self.tasks[task.name] = record

    def _upstream(self, task: TaskDef, without: str | None = None) -> Mapping[str, Any]:
        """Each dependency's result (None for one that did not succeed), as ``ctx.upstream``;
        a map's items do not get the list they map over (``without``). The handler gets its own
        copy (:meth:`_call`), as each worker reads its own from the database."""
        return {d: self.tasks[d].result for d in task.depends_on if d != without}

    def _event(self, task: TaskDef) -> LocalTask:
        assert task.wait_for_event is not None
        name, key = task.wait_for_event.name, self.event_keys.get(task.name) or ""
        for lookup in ((name, key), name):
            if lookup in self.events:
                data = _read_back(to_json(self.events[lookup], f"events[{lookup!r}]"))
                return LocalTask(task.name, TaskState.SUCCEEDED, result=data)
        return LocalTask(
            task.name,
            TaskState.DEAD,
            failure_reason=FailureReason.EVENT_TIMEOUT,
            error=f"no event {name} arrived for its key before the timeout",
        )

    def _map(self, task: TaskDef) -> LocalTask:
        assert task.for_each is not None
        templates = next(t for t in self.definition.to_dict()["tasks"] if t["name"] == task.name)
        source = self.tasks[task.for_each].result
        planned = plan_items(
            source,
            self.input,
            templates,
            self.definition.max_items,
            source_name=repr(task.for_each),
        )
        if isinstance(planned, MapFailure):
            return LocalTask(
                task.name, TaskState.DEAD, failure_reason=planned.reason, error=planned.error
            )
        record = LocalTask(task.name, TaskState.RUNNING)
        upstream = self._upstream(task, without=task.for_each)
        stopped = False  # fail-fast after an item died: the items not started are cancelled
        for index, item in enumerate(source):
            name = item_name(task.name, index)
            if stopped:
                record.items.append(_cancelled(name, CancelCause.UPSTREAM))
                continue
            key = planned.idempotency_keys[index]
            done = self._execute(task, name, upstream, key, item=item, index=index)
            record.items.append(done)
            if done.state is TaskState.DEAD and self.definition.fail_fast:
                stopped = True
                self._fail_fast()
        return _settled(record)

    def _child(self, task: TaskDef) -> LocalTask:
        """Each attempt runs a child run of ``task.workflow`` here, to its end: SUCCEEDED
        with its leaves' results, or the attempt fails and the task's ``retry`` applies."""
        record = LocalTask(task.name, TaskState.RUNNING)
        for number in range(1, task.retry.max_attempts + 1):
            failure = self._child_attempt(task, record)
            if failure is None:
                record.attempts.append(LocalAttempt(number, TaskState.SUCCEEDED.value))
                return record
            if not self._route(task, record, number, *failure):
                return record
        return record

    def _child_attempt(self, task: TaskDef, record: LocalTask) -> tuple[FailureReason, str] | None:
        """None when the child run SUCCEEDED (``record`` then holds its result)."""
        assert task.workflow is not None
        definition = self.runner.workflows.get(task.workflow)
        if definition is None:
            return (
                FailureReason.CHILD_WORKFLOW_UNKNOWN,
                f"workflow {task.workflow!r} is not one of this runner's workflows",
            )
        if self.depth + 1 > MAX_CHILD_DEPTH:
            return (
                FailureReason.CHILD_DEPTH_EXCEEDED,
                f"a child run would be nested more than {MAX_CHILD_DEPTH} levels deep",
            )
        child = _Execution(self.runner, definition, self.events, self.depth + 1)
        try:
            child_input = (
                self.input
                if task.input is None
                else render_input(
                    task.input, self.input, self._upstream(task), f"task {task.name!r}"
                )
            )
            ran = child.run(child_input, {})
        except InputError as exc:
            return (FailureReason.CHILD_INPUT_ERROR, str(exc))
        record.children.append(ran)
        if ran.state is RunState.SUCCEEDED:
            _succeeded(record, _leaves(definition, ran))
            return None
        if ran.state is RunState.CANCELLED:
            return (FailureReason.CHILD_CANCELLED, f"child run {child.run_id} CANCELLED")
        return (FailureReason.CHILD_FAILED, f"child run {child.run_id} {ran.state}")

    def _execute(
        self,
        task: TaskDef,
        name: str,
        upstream: Mapping[str, Any],
        key: str | None,
        *,
        item: Any = None,
        index: int | None = None,
    ) -> LocalTask:
        """Attempts of one handler task (or map item) until it succeeds or is DEAD."""
        record = LocalTask(name, TaskState.RUNNING, idempotency_key=key)
        task_run_id = uuid4()
        for number in range(1, task.retry.max_attempts + 1):
            if key is not None and key in self.runner._keys:
                record.attempts.append(LocalAttempt(number, REUSED))
                return _succeeded(record, self.runner._keys[key])
            finish, duration = self._call(task, name, upstream, number, task_run_id, item, index)
            if finish.state is TaskState.SUCCEEDED:
                result = _read_back(finish.result)
                record.attempts.append(LocalAttempt(number, "SUCCEEDED", duration_s=duration))
                if key is not None:
                    self.runner._keys[key] = result
                return _succeeded(record, result)
            reason = finish.reason or FailureReason.HANDLER_ERROR
            error = finish.error or ""
            if not self._route(task, record, number, reason, error, finish.traceback, duration):
                return record
        return record

    def _call(
        self,
        task: TaskDef,
        name: str,
        upstream: Mapping[str, Any],
        number: int,
        task_run_id: UUID,
        item: Any,
        index: int | None,
    ) -> tuple[Finish, float]:
        """One call of the handler, judged as the worker judges it."""
        fn = self.runner.handlers.get(task.handler)
        if fn is None:
            error = f"no handler is registered as {task.handler!r} in this worker"
            return Finish(TaskState.FAILED, reason=FailureReason.UNKNOWN_HANDLER, error=error), 0
        # plain dicts of their own, as a worker reads them: what one handler changes in them
        # reaches no other task; past the worker's bound, the views a worker's claim gives
        inline, page = self.runner._upstream_bounds
        pages = InMemoryUpstream(inline)
        given = bounded(pages.claim(_copy(upstream), task_run_id), pages, page)
        ctx = TaskContext(
            _copy(self.input), given, number, task_run_id, self.run_id, name,
            item=_copy(item), index=index,
        )  # fmt: skip
        job = Job(fn, ctx, task.timeout)
        started = self.runner._clock()
        if job.asynchronous:  # on an event loop, as a worker runs it (its timeout applied)
            self.runner._event_loop().submit([job])
            job.done.wait()
        else:
            job.run()
        duration = self.runner._clock() - started
        if isinstance(job.error, KeyboardInterrupt):  # the tester's Ctrl-C, not the handler's
            raise job.error
        finish = classify(job, self.runner._max_result_bytes)
        if task.timeout is not None and duration > task.timeout:
            finish = Finish(
                TaskState.FAILED,
                reason=FailureReason.TIMEOUT,
                error=f"the handler ran longer than its timeout of {task.timeout}s",
            )
        return finish, duration

    def _route(
        self,
        task: TaskDef,
        record: LocalTask,
        number: int,
        reason: FailureReason,
        error: str,
        traceback: str | None = None,
        duration: float = 0.0,
    ) -> bool:
        """Record a failed attempt and route it by the retry policy: True to try again
        (after the backoff, slept only if the runner was given ``sleep``), False when DEAD."""
        facts = policy.FailureFacts(reason, attempts_used=number, crash_streak=0)
        decision = policy.decide(task.retry, facts, self.runner._rand)
        delay = decision.delay if isinstance(decision, policy.Retry) else None
        record.attempts.append(
            LocalAttempt(number, "FAILED", reason, error, traceback, duration, delay)
        )
        record.error = error
        if delay is None:
            record.state = TaskState.DEAD
            record.failure_reason = decision.reason if isinstance(decision, policy.Bury) else reason
            return False
        if self.runner._sleep is not None:
            self.runner._sleep(delay)
        return True


def _leaves(definition: WorkflowDef, run: LocalRun) -> dict[str, Any]:
    """A child's result: each leaf task (nothing depends on it) to its result."""
    inner = {d for t in definition.tasks for d in t.depends_on}
    return {t.name: run.tasks[t.name].result for t in definition.tasks if t.name not in inner}


def _settled(record: LocalTask) -> LocalTask:
    """A map from its items, as ``settle_maps``: an item DEAD → DEAD ``item_failed``; else one
    CANCELLED → CANCELLED; else SUCCEEDED with the results in item order."""
    dead = [i for i in record.items if i.state is TaskState.DEAD]
    cancelled = [i for i in record.items if i.state is TaskState.CANCELLED]
    if dead:
        record.state = TaskState.DEAD
        record.failure_reason = FailureReason.ITEM_FAILED
        record.error = f"{len(dead)} item(s) DEAD"
    elif cancelled:
        record.state = TaskState.CANCELLED
        record.failure_reason = FailureReason.CANCELLED
        record.cancel_cause = cancelled[0].cancel_cause
    else:
        _succeeded(record, [i.result for i in record.items])
    return record


def _succeeded(record: LocalTask, result: Any) -> LocalTask:
    record.state = TaskState.SUCCEEDED
    record.result = result
    record.error = None
    return record


def _cancelled(name: str, cause: CancelCause) -> LocalTask:
    record = LocalTask(name, TaskState.CANCELLED, failure_reason=FailureReason.CANCELLED)
    record.cancel_cause = cause
    return record


def _copy(value: Any) -> Any:
    """A deep copy of a value read back from JSON (it holds only JSON types)."""
    return json.loads(json.dumps(value))


def _read_back(text: str | None) -> Any:
    """A checked result as the next task receives it: parsed back from its JSON text."""
    return None if text is None else json.loads(text)
