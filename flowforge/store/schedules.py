"""Schedules (SPEC 7.2): the scheduler's sync and fire pass, and the operator's actions.

Exactly one run per (schedule, fire time), however many schedulers race and whatever dies
when, because the database decides:

- a pass locks the due schedule rows ``FOR UPDATE SKIP LOCKED`` (a row another scheduler is
  firing is skipped; one it fired meanwhile is no longer due when re-checked), and reads
  ``now()`` in that transaction: every fire time is computed from the database clock;
- each decision is a ``schedule_fires`` row, unique on (schedule, fire time): a fire time
  decided once is never decided again, and only the decisions that were inserted make runs;
- the decisions, the runs (through the trigger's own :func:`~flowforge.store.triggers.insert_plan`),
  their ``schedule``/``fire_time`` stamps, the cancellation of a previous run (``overlap:
  cancel_previous``) and the schedule's next fire time commit in ONE transaction per batch:
  a scheduler that dies mid-pass leaves nothing half-made.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import FireRecord, ManualFire, ScheduleInfo, ScheduleSync
from flowforge.domain.plan import RunPlan, plan_runs
from flowforge.domain.schedule import (
    Decision,
    Fire,
    ScheduleDef,
    SkipReason,
    decide,
    paused_span,
)
from flowforge.domain.states import CancelCause
from flowforge.domain.values import check_text
from flowforge.errors import (
    DefinitionError,
    InputError,
    NotFoundError,
    ScheduleRetiredError,
    UnknownWorkflowError,
)
from flowforge.store import rows
from flowforge.store.part import Part, Tx
from flowforge.store.runs import derive_states, stop_runs
from flowforge.store.triggers import insert_plan

logger = logging.getLogger(__name__)

#: Decisions ``fire_history`` returns unless asked for another number.
HISTORY = 20


class Schedules(Part):
    """The ``schedules`` table and its decisions (``schedule_fires``)."""

    def sync(self, workflows: Mapping[str, WorkflowDef]) -> ScheduleSync:
        """Make the table match the schedules of ``workflows`` (a scheduler's files), in one
        transaction: new ones start at their first fire time after the database's now; a
        changed one moves to its new spec's first fire time at or after its old next one (no
        fire time decided twice, none skipped over); one whose workflow no longer lists it is
        retired. Schedules of other workflows are left alone (another tree's files)."""
        return self._transaction(_sync, workflows)

    def fire_due(
        self, workflows: Mapping[str, WorkflowDef], limit: int, queue: str | None = None
    ) -> list[FireRecord]:
        """Decide the due fire times of up to ``limit`` due schedules of ``workflows`` in one
        transaction (catch-up and overlap per each schedule's policy), creating their runs,
        whose tasks that name no queue go to ``queue`` (the firing scheduler's
        ``broker.queue``); the decisions made (empty when nothing was due)."""
        if not workflows:
            return []
        return self._transaction(_fire_due, workflows, limit, queue)

    def list_schedules(
        self, after: str | None = None, limit: int | None = None
    ) -> list[ScheduleInfo]:
        """Schedules by name — after the name ``after`` (None: from the first), at most
        ``limit`` (None: all) — each with its state, next and last fire time, its last run's
        state and its last decision."""
        found = self._query(
            "list_schedules",
            {"name": None, "after": None if after is None else _name(after), "limit": limit},
        )
        return [rows.schedule_info(r) for r in found]

    def get_schedule(self, name: str) -> ScheduleInfo:
        """One schedule; :class:`NotFoundError` if there is none of that name."""
        found = self._query("list_schedules", _one(_name(name)))
        if not found:
            raise NotFoundError(f"no schedule named {name!r}")
        return rows.schedule_info(found[0])

    def fire_history(self, name: str, limit: int = HISTORY) -> list[FireRecord]:
        """The latest ``limit`` decisions of schedule ``name``, newest first."""
        found = self._query("schedule_fire_history", {"name": _name(name), "limit": limit})
        return [rows.fire_record(r) for r in found]

    def pause_schedule(self, name: str) -> ScheduleInfo:
        """Stop firing ``name`` until resumed (pausing a paused one changes nothing)."""
        return self._transaction(_pause, _name(name))

    def resume_schedule(self, name: str) -> ScheduleInfo:
        """Fire ``name`` again from its next fire time after the database's now; the fire times
        that passed while it was paused are recorded as one skipped span (reason paused)."""
        return self._transaction(_resume, _name(name))

    def trigger_schedule(
        self, name: str, workflows: Mapping[str, WorkflowDef], queue: str | None = None
    ) -> ManualFire:
        """A run of schedule ``name`` now, outside its timetable (paused or not): recorded as a
        manual fire at the database's clock, which never takes a timetable fire time. Its
        tasks that name no queue go to ``queue`` (the caller's ``broker.queue``)."""
        return self._transaction(_trigger, _name(name), workflows, queue)

    def purge_fires(self, age_s: float, limit: int) -> int:
        """Delete up to ``limit`` decisions older than ``age_s`` seconds (database clock)."""
        return len(self._query("purge_schedule_fires", {"age_s": age_s, "limit": limit}))


def _one(name: str) -> dict[str, Any]:
    """The parameters of ``list_schedules`` for the schedule called ``name``."""
    return {"name": name, "after": None, "limit": None}


def _name(name: str) -> str:
    return check_text(name, "the schedule name")


# ---------------------------------------------------------------- sync


def _sync(tx: Tx, workflows: Mapping[str, WorkflowDef]) -> ScheduleSync:
    wanted = {
        name: (workflow.name, schedule)
        for workflow in workflows.values()
        for name, schedule in workflow.named_schedules()
    }
    found = tx.all("lock_synced_schedules", {"workflows": list(workflows), "names": list(wanted)})
    existing = {r["name"]: r for r in found}
    now = found[0]["now"] if found else None
    added: list[str] = []
    changed: list[str] = []
    upserts: list[tuple[str, str, Mapping[str, Any], datetime | None]] = []
    for name, (workflow, schedule) in sorted(wanted.items()):
        spec = schedule.to_spec()
        row = existing.get(name)
        if row is not None and row["retired_at"] is None:
            if row["spec"] == spec and row["workflow"] == workflow:
                continue
            # every fire time before the old next one is decided, none after it is
            start = row["next_fire_at"]
            next_at = schedule.at_or_after(start) if start is not None else None
            changed.append(name)
        else:
            next_at = None
            added.append(name)
        if next_at is None:
            now = now or _now(tx)
            next_at = schedule.next_after(now)
        upserts.append((name, workflow, spec, next_at))
    if upserts:
        tx.all("upsert_schedules", rows.schedule_columns(upserts))
    retired = tx.all("retire_schedules", {"workflows": list(workflows), "names": list(wanted)})
    return ScheduleSync(tuple(added), tuple(changed), tuple(sorted(r["name"] for r in retired)))


def _now(tx: Tx) -> datetime:
    found = tx.one("database_now")
    assert found is not None
    return found["now"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the fire pass


Decided = Sequence[tuple[Mapping[str, Any], ScheduleDef, Decision]]


def _fire_due(
    tx: Tx, workflows: Mapping[str, WorkflowDef], limit: int, queue: str | None
) -> list[FireRecord]:
    due = tx.all("lock_due_schedules", {"workflows": list(workflows), "limit": limit})
    decided = _decide_all(due)
    if not decided:
        return []
    plans = _plan(workflows, decided, queue)
    fires = _with_runs(decided, plans)
    inserted = tx.all("insert_fires", rows.fire_columns(fires))
    created = {
        (r["schedule"], r["fire_time"]): r["run_id"] for r in inserted if r["run_id"] is not None
    }
    made = set(created.values())
    for workflow, plan in plans.by_workflow.items():
        keep = {rid for rid in plan.run_ids if rid in made}
        if keep:
            insert_plan(tx, workflows[workflow], _subplan(plan, keep))
    if created:
        tx.all(
            "stamp_schedule_runs",
            {
                "ids": list(created.values()),
                "schedules": [name for name, _ in created],
                "fire_times": [fire_time for _, fire_time in created],
            },
        )
    _cancel_previous(tx, decided, created)
    tx.all("advance_schedules", _advance(decided, created))
    kept = {(r["schedule"], r["fire_time"]) for r in inserted}
    return [
        FireRecord(
            schedule=name,
            fire_time=fire.fire_time,
            outcome="created" if fire.created else "skipped",
            reason=None if fire.reason is None else str(fire.reason),
            last_fire_time=fire.last_fire_time,
            run_id=run_id,
        )
        for name, fire, run_id in fires
        if (name, fire.fire_time) in kept
    ]


def _decide_all(due: Sequence[Mapping[str, Any]]) -> Decided:
    decided: list[tuple[Mapping[str, Any], ScheduleDef, Decision]] = []
    for row in due:
        try:
            schedule = ScheduleDef.from_spec(row["spec"])
        except DefinitionError as exc:  # written by another version of FlowForge: leave it
            logger.error("schedule %r has a spec this scheduler cannot read: %s", row["name"], exc)
            continue
        decision = decide(schedule, row["next_fire_at"], row["now"], row["previous_unfinished"])
        decided.append((row, schedule, decision))
    return decided


def _with_runs(decided: Decided, plans: _Plans) -> list[tuple[str, Fire, UUID | None]]:
    """Each decision with the run planned for it; a fire whose run could not be planned (the
    workflow refused the schedule's input) becomes a skip."""
    fires: list[tuple[str, Fire, UUID | None]] = []
    for row, _, decision in decided:
        for fire in decision.fires:
            run_id = plans.run_of.get((row["name"], fire.fire_time))
            if fire.created and run_id is None:
                fire = Fire(fire.fire_time, created=False, reason=SkipReason.INVALID_INPUT)
            fires.append((row["name"], fire, run_id))
    return fires


class _Plans:
    """The runs a pass creates, planned per workflow; ``run_of`` maps (schedule, fire time)
    to its planned run."""

    def __init__(self) -> None:
        self.by_workflow: dict[str, RunPlan] = {}
        self.run_of: dict[tuple[str, datetime], UUID] = {}


def _plan(
    workflows: Mapping[str, WorkflowDef],
    decided: Decided,
    queue: str | None,
) -> _Plans:
    """Plan every created fire's run, a workflow's in one plan; a schedule whose input the
    workflow refuses (its file changed under another tree's spec) plans nothing."""
    wanted: dict[str, list[tuple[str, datetime, Mapping[str, Any]]]] = {}
    for row, schedule, decision in decided:
        workflow = workflows[row["workflow"]]
        try:
            plan_runs(workflow, [schedule.input])
        except InputError as exc:
            logger.error("schedule %r: its input does not fit workflow: %s", row["name"], exc)
            continue
        for fire in decision.fires:
            if fire.created:
                wanted.setdefault(row["workflow"], []).append(
                    (row["name"], fire.fire_time, schedule.input)
                )
    plans = _Plans()
    for name, entries in wanted.items():
        plan = plan_runs(workflows[name], [run_input for _, _, run_input in entries], queue=queue)
        plans.by_workflow[name] = plan
        for (schedule_name, fire_time, _), run_id in zip(entries, plan.run_ids, strict=True):
            plans.run_of[(schedule_name, fire_time)] = run_id
    return plans


def _subplan(plan: RunPlan, keep: set[UUID]) -> RunPlan:
    """``plan`` without the runs not in ``keep`` (fire times another pass decided first)."""
    if len(keep) == len(plan.run_ids):
        return plan
    index = [i for i, rid in enumerate(plan.run_ids) if rid in keep]
    tasks = plan.tasks_of(keep)
    edges = plan.edges_of({t.id for t in tasks})
    return RunPlan(
        run_ids=[plan.run_ids[i] for i in index],
        inputs=[plan.inputs[i] for i in index],
        keys=[plan.keys[i] for i in index],
        digests=[plan.digests[i] for i in index],
        tasks=tasks,
        upstream=edges.upstream,
        downstream=edges.downstream,
        upstream_names=edges.names,
    )


def _cancel_previous(
    tx: Tx,
    decided: Decided,
    created: Mapping[tuple[str, datetime], UUID],
) -> None:
    """``overlap: cancel_previous``: the run before each such fire is cancelled, through the
    operator's statements (tasks not started cancelled, running ones asked to stop)."""
    targets: list[UUID] = []
    for row, _, decision in decided:
        previous: UUID | None = row["last_run_id"]
        for fire in decision.fires:
            run_id = created.get((row["name"], fire.fire_time))
            if run_id is None:
                continue
            if fire.cancel_previous and previous is not None:
                targets.append(previous)
            previous = run_id
    if not targets:
        return
    stop_runs(tx, targets, CancelCause.OPERATOR)
    for target in targets:
        tx.one("mark_run_cancel_requested", {"id": target})
    derive_states(tx, targets)
    tx.all("notify_scheduler")


def _advance(
    decided: Decided,
    created: Mapping[tuple[str, datetime], UUID],
) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {"names": [], "next": [], "last": [], "run_ids": []}
    for row, _, decision in decided:
        last = max((f.last_fire_time or f.fire_time for f in decision.fires), default=None)
        keys = [(row["name"], f.fire_time) for f in decision.fires]
        runs = [created[k] for k in keys if k in created]
        columns["names"].append(row["name"])
        columns["next"].append(decision.next_fire_at)
        columns["last"].append(last)
        columns["run_ids"].append(runs[-1] if runs else None)
    return columns


# ---------------------------------------------------------------- operator actions


def _locked(tx: Tx, name: str) -> Mapping[str, Any]:
    row = tx.one("lock_schedule", {"name": name})
    if row is None:
        raise NotFoundError(f"no schedule named {name!r}")
    if row["retired_at"] is not None:
        raise ScheduleRetiredError(
            f"schedule {name!r} is retired: its workflow file no longer defines it"
        )
    return row


def _info(tx: Tx, name: str) -> ScheduleInfo:
    row = tx.one("list_schedules", _one(name))
    assert row is not None  # locked by this transaction
    return rows.schedule_info(row)


def _pause(tx: Tx, name: str) -> ScheduleInfo:
    _locked(tx, name)
    tx.all("pause_schedule", {"name": name})
    return _info(tx, name)


def _resume(tx: Tx, name: str) -> ScheduleInfo:
    row = _locked(tx, name)
    if row["paused"]:
        schedule = ScheduleDef.from_spec(row["spec"])
        span = paused_span(schedule, row["next_fire_at"], row["now"])
        next_at = row["next_fire_at"]
        if span is not None:
            tx.all("insert_fires", rows.fire_columns([(name, span, None)]))
            next_at = schedule.next_after(row["now"])
        tx.all("resume_schedule", {"name": name, "next": next_at})
    return _info(tx, name)


def _trigger(
    tx: Tx, name: str, workflows: Mapping[str, WorkflowDef], queue: str | None
) -> ManualFire:
    row = _locked(tx, name)
    workflow = workflows.get(row["workflow"])
    if workflow is None:
        raise UnknownWorkflowError(
            f"schedule {name!r} runs workflow {row['workflow']!r}, which is not configured here"
        )
    schedule = ScheduleDef.from_spec(row["spec"])
    plan = plan_runs(workflow, [schedule.input], queue=queue)
    run_id = plan.run_ids[0]
    fired = tx.one("insert_manual_fire", {"schedule": name, "run_id": run_id})
    assert fired is not None
    insert_plan(tx, workflow, plan)
    stamp = {"ids": [run_id], "schedules": [name], "fire_times": [fired["fire_time"]]}
    tx.all("stamp_schedule_runs", stamp)
    tx.all("note_manual_run", {"name": name, "run_id": run_id})
    return ManualFire(name, run_id, fired["fire_time"])
