"""Planning the rows of new runs: pure, so a batch of triggers becomes a few array inserts.

A plan holds, column by column, every run, task run and edge to insert — validated inputs,
rendered key templates, request digests for trigger idempotency — before any SQL runs.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from flowforge.domain.dag import WorkflowDef, render_key
from flowforge.domain.values import JsonText, check_text, to_json
from flowforge.errors import InputError

TASK_COLUMNS = (
    "run_ids",
    "ids",
    "names",
    "handlers",
    "pending",
    "max_attempts",
    "base_delays",
    "max_delays",
    "jitters",
    "timeouts",
    "idem_keys",
    "ordering_keys",
    "on_dead",
)


@dataclass
class RunPlan:
    """Columns for ``insert_runs``, ``insert_tasks`` and ``insert_edges``."""

    run_ids: list[UUID] = field(default_factory=list)
    inputs: list[JsonText] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    tasks: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in TASK_COLUMNS})
    upstream: list[UUID] = field(default_factory=list)
    downstream: list[UUID] = field(default_factory=list)

    def ordering_keys(self) -> list[str]:
        return sorted({k for k in self.tasks["ordering_keys"] if k is not None})

    def tasks_of(self, runs: set[UUID]) -> dict[str, list[Any]]:
        """Task columns restricted to ``runs`` (the runs actually inserted)."""
        keep = [i for i, run_id in enumerate(self.tasks["run_ids"]) if run_id in runs]
        if len(keep) == len(self.tasks["run_ids"]):
            return self.tasks
        return {k: [column[i] for i in keep] for k, column in self.tasks.items()}

    def edges_of(self, tasks: set[UUID]) -> tuple[list[UUID], list[UUID]]:
        pairs = [(u, d) for u, d in zip(self.upstream, self.downstream, strict=True) if d in tasks]
        return [u for u, _ in pairs], [d for _, d in pairs]


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
) -> RunPlan:
    """Rows for one run of ``workflow`` per input; :class:`InputError` names the bad one."""
    keys = [None] * len(inputs) if keys is None else list(keys)
    if len(keys) != len(inputs):
        raise InputError("one idempotency key (or None) is needed per input")
    plan = RunPlan()
    ordered = workflow.topological_order()
    for index, (raw, key) in enumerate(zip(inputs, keys, strict=True)):
        run_input = {} if raw is None else raw
        if not isinstance(run_input, Mapping):
            raise InputError(_where(index, len(inputs)) + "the run input must be a JSON object")
        where = _where(index, len(inputs))
        stored = to_json(run_input, f"{where}the run input")
        if key is not None:
            key = check_text(key, f"{where}the idempotency key")
        run_id = uuid.uuid4()
        plan.run_ids.append(run_id)
        plan.inputs.append(stored)
        plan.keys.append(key)
        plan.digests.append(request_digest(workflow.name, stored))
        ids = {t.name: uuid.uuid4() for t in ordered}
        for task in ordered:
            label = f"{_where(index, len(inputs))}task {task.name!r}"
            row = (
                run_id,
                ids[task.name],
                task.name,
                task.handler,
                len(task.depends_on),
                task.retry.max_attempts,
                task.retry.base_delay,
                task.retry.max_delay,
                str(task.retry.jitter),
                task.timeout,
                _render(task.idempotency_key, run_input, f"{label} idempotency_key"),
                _render(task.ordering_key, run_input, f"{label} ordering_key"),
                str(task.on_dead),
            )
            for column, value in zip(TASK_COLUMNS, row, strict=True):
                plan.tasks[column].append(value)
            for dep in task.depends_on:
                plan.upstream.append(ids[dep])
                plan.downstream.append(ids[task.name])
    return plan


def _render(template: str | None, run_input: Mapping[str, Any], label: str) -> str | None:
    """A task's key from its template; refused if PostgreSQL could not store or index it."""
    if template is None:
        return None
    return check_text(render_key(template, run_input, label), label)


def _where(index: int, total: int) -> str:
    return f"input {index}: " if total > 1 else ""
