"""Every row ↔ object mapping of the store: rows to the domain's objects, objects to the
parameters of ``queries.sql`` (whose names are storage naming: they stay here, not in the domain).

Parameters are sent as arrays (one statement for a whole batch), so an object-to-parameters
mapping returns columns: ``{parameter name: [value per object]}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from flowforge.domain.conditions import RunIf
from flowforge.domain.control import KeyTask
from flowforge.domain.model import (
    DEFAULT_UPSTREAM_INLINE,
    Attempt,
    AuditEntry,
    ChildRun,
    Claim,
    DeadCount,
    DeadPurge,
    DeadTask,
    Dispatch,
    EventSent,
    Finish,
    Finished,
    FinishedMinute,
    FireRecord,
    LargeUpstream,
    LiveProcesses,
    MapItem,
    OutboxBacklog,
    Overview,
    PoisonCandidate,
    ProcessInfo,
    QueueLoad,
    RerunEntry,
    RetryBacklog,
    Routed,
    Run,
    ScheduleInfo,
    Stats,
    TaskRun,
    WokenTask,
)
from flowforge.domain.output import AttemptLog, Captured, Output, Progress
from flowforge.domain.plan import PlannedTask
from flowforge.domain.policy import FailureFacts, Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason, RunFailureReason
from flowforge.domain.schedule import Fire
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.domain.timeline import MapRest, TaskKind, TimelineTask
from flowforge.domain.values import (
    MAX_ERROR_CHARS,
    MAX_TRACEBACK_CHARS,
    JsonText,
    clean_text,
    to_json,
)

Row = Mapping[str, Any]

#: The attempt outcome a finish writes, by the state it writes.
OUTCOMES = {
    TaskState.SUCCEEDED: "succeeded",
    TaskState.FAILED: "failed",
    TaskState.CANCELLED: "cancelled",
}


# ---------------------------------------------------------------------- rows → objects


def _reason(value: str | None) -> FailureReason | None:
    return FailureReason(value) if value else None


def task_run(row: Row) -> TaskRun:
    return TaskRun(
        id=row["id"],
        run_id=row["run_id"],
        name=row["name"],
        handler=row["handler"],
        state=TaskState(row["state"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        fencing_token=row["fencing_token"],
        failure_reason=_reason(row["failure_reason"]),
        last_error=row["last_error"],
        result=row["result"],
        idempotency_key=row["idempotency_key"],
        ordering_key=row["ordering_key"],
        lease_owner=row["lease_owner"],
        lease_expires_at=row["lease_expires_at"],
        retry_at=row["retry_at"],
        cancel_requested=row["cancel_requested"],
        created_at=row["created_at"],
        ready_at=row["ready_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        depends_on=tuple(row["depends_on"] or ()),
        sleep_s=row["sleep_s"],
        wake_at=row["wake_at"],
        run_if=RunIf(row.get("run_if") or RunIf.ALL_SUCCEEDED),
        cancel_cause=_cause(row.get("cancel_cause")),
        event_name=row.get("event_name"),
        event_key=row.get("event_key"),
        for_each=row.get("for_each"),
        item_counts=row.get("item_counts"),
        map_id=row.get("map_id"),
        item_index=row.get("item_index"),
        child_workflow=row.get("child_workflow"),
        child_run_id=row.get("child_run_id"),
        queue=row.get("queue"),
        concurrency_key=row.get("concurrency_key"),
        concurrency_limit=row.get("concurrency_limit"),
        rate_key=row.get("rate_key"),
        rate_limit=row.get("rate_limit"),
        rate_per_s=row.get("rate_per_s"),
        breaker_key=row.get("breaker_key"),
        waiting_on=row.get("waiting_on"),
        priority=row.get("priority") or 0,
        progress=_progress(row),
    )


def _progress(row: Row) -> Progress | None:
    fraction = row.get("progress")
    return None if fraction is None else Progress(fraction, row.get("progress_message") or "")


def attempt_log(row: Row, task_run_id: UUID) -> AttemptLog:
    """A ``get_attempt_output`` row (its attempt columns NULL: no attempt to show)."""
    return AttemptLog(
        task_run_id=task_run_id,
        task_state=TaskState(row["state"]),
        attempts=row["attempts"],
        attempt=row["attempt"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        outcome=row["outcome"],
        output=Output(row["output"] or "", row["output_dropped"] or 0),
    )


def map_item(row: Row) -> MapItem:
    """A ``map_items_page`` row."""
    return MapItem(
        id=row["id"],
        index=row["item_index"],
        state=TaskState(row["state"]),
        attempt=row["attempt"],
        failure_reason=_reason(row["failure_reason"]),
        last_error=row["last_error"],
        item=row["item"],
        result=row["result"],
        idempotency_key=row["idempotency_key"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        waiting_on=row["waiting_on"],
    )


def _cause(value: str | None) -> CancelCause | None:
    return None if value is None else CancelCause(value)


def dead_task(row: Row) -> DeadTask:
    """A ``list_dead`` row: a task run plus the workflow of its run."""
    task = task_run(row)
    return DeadTask(
        **{f.name: getattr(task, f.name) for f in fields(task)}, workflow=row["workflow"]
    )


def run(row: Row, tasks: tuple[TaskRun, ...] = (), children: tuple[ChildRun, ...] = ()) -> Run:
    return Run(
        id=row["id"],
        workflow=row["workflow"],
        state=RunState(row["state"]),
        input=row["input"],
        idempotency_key=row["idempotency_key"],
        cancel_requested=row["cancel_requested_at"] is not None,
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        tasks=tasks,
        start_at=row["start_at"],
        deadline_at=row["deadline_at"],
        failure_reason=RunFailureReason(row["failure_reason"]) if row["failure_reason"] else None,
        schedule=row.get("schedule"),
        fire_time=row.get("fire_time"),
        parent_run_id=row.get("parent_run_id"),
        parent_task_id=row.get("parent_task_id"),
        children=children,
    )


def child_run(row: Row) -> ChildRun:
    """A ``run_children`` row."""
    return ChildRun(
        task=row["task"],
        task_run_id=row["task_run_id"],
        attempt=row["attempt"],
        run_id=row["run_id"],
        workflow=row["workflow"],
        state=RunState(row["state"]),
    )


def attempt(row: Row) -> Attempt:
    return Attempt(
        task_run_id=row["task_run_id"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        worker=row["worker"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        outcome=row["outcome"],
        failure_reason=_reason(row["failure_reason"]),
        error=row["error"],
        traceback=row["traceback"],
    )


def audit_entry(row: Row) -> AuditEntry:
    return AuditEntry(
        requested_by=row["requested_by"],
        reason=row["reason"],
        previous_reason=row["previous_reason"],
        attempt=row["attempt"],
        requested_at=row["requested_at"],
        action=row["action"],
        previous_state=row["previous_state"],
        new_state=row["new_state"],
    )


def rerun_entry(row: Row) -> RerunEntry:
    return RerunEntry(
        requested_by=row["requested_by"],
        reason=row["reason"],
        from_task=row["from_task"],
        previous_state=RunState(row["previous_state"]),
        task_run_ids=tuple(row["task_run_ids"]),
        task_names=tuple(row["task_names"]),
        requested_at=row["requested_at"],
    )


def claim(row: Row) -> Claim:
    """A ``claim`` row."""
    return Claim(
        task_run_id=row["id"],
        run_id=row["run_id"],
        name=row["name"],
        handler=row["handler"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        input=row["input"],
        upstream=row["upstream"] or {},
        timeout_s=row["timeout_s"],
        idempotency_key=row["idempotency_key"],
        dispatch_lag_s=row["dispatch_lag_s"] or 0.0,
        workflow=row["workflow"],
        item=row.get("item"),
        index=row.get("item_index"),
        upstream_large={
            name: large_upstream(ref) for name, ref in (row.get("upstream_large") or {}).items()
        },
        upstream_deferred=None if row.get("upstream") is not None else row.get("upstream_n"),
        payload_bytes=row.get("payload_bytes") or 0,
    )


def large_upstream(ref: Mapping[str, Any]) -> LargeUpstream:
    """One entry of the ``claim`` query's ``upstream_large`` (or a row of
    ``upstream_names_page`` with a length): an upstream list left out of the claim."""
    return LargeUpstream(UUID(str(ref["id"])), int(ref["n"]), bool(ref["items"]))


def finished(found: Sequence[Row]) -> Finished:
    """The ``finish`` query's rows: finished ids (no ready token; each also carries the
    statement's outbox counts), then released dependents."""
    head = next((row for row in found if row["ready_token"] is None), None)
    queued = int(head["queued"]) if head is not None else 0
    published = int(head["published"]) if head is not None else 0
    return Finished(
        committed=frozenset(row["id"] for row in found if row["ready_token"] is None),
        ready=tuple(
            (row["id"], row["ready_token"]) for row in found if row["ready_token"] is not None
        ),
        queued=queued,
        unpublished=queued - published,
    )


def held_leases(found: Sequence[Row]) -> dict[UUID, bool]:
    """The ``renew_leases`` rows: ``{task run id: cancel requested}`` of the leases held."""
    return {row["id"]: bool(row["cancel_requested"]) for row in found}


def retry_policy(row: Row) -> RetryPolicy:
    """A ``lock_failed`` / ``lock_expired_leases`` row's retry policy."""
    return RetryPolicy(
        row["max_attempts"], row["base_delay_s"], row["max_delay_s"], Jitter(row["jitter"])
    )


def failure_facts(row: Row, *, lease_expired: bool = False) -> FailureFacts:
    """A ``lock_failed`` row (a FAILED task's attempt as the retry policy sees it), or with
    ``lease_expired`` a ``lock_expired_leases`` row: a lapsed lease counts as one more crash."""
    if lease_expired:  # the row has no failure_reason: the lease is the reason
        reason = FailureReason.LEASE_EXPIRED
    else:
        reason = FailureReason(row["failure_reason"] or FailureReason.HANDLER_ERROR)
    return FailureFacts(
        reason=reason,
        attempts_used=row["attempt"] - row["budget_start"],
        crash_streak=row["crash_streak"] + (1 if lease_expired else 0),
        cancel_requested=row["cancel_requested"],
        bury_requested=row["bury_requested"],
    )


def routed(row: Row, source: TaskState, delay_s: float, reason: str) -> Routed:
    """What ``apply_routing`` / ``apply_reap`` returned for one task, with its decision."""
    state = TaskState(row["state"])
    return Routed(
        task_run_id=row["id"],
        run_id=row["run_id"],
        workflow=row["workflow"],
        task=row["name"],
        attempt=row["attempt"],
        source=source,
        state=state,
        reason=FailureReason(reason),
        delay_s=delay_s if state is TaskState.RETRYING else 0.0,
    )


def dispatch(row: Row) -> Dispatch:
    """A ``lock_outbox`` row."""
    return Dispatch(
        row["id"], row["task_run_id"], row["fencing_token"], row["queue"], row["priority"]
    )


def process_info(row: Row) -> ProcessInfo:
    """A ``list_processes`` row."""
    return ProcessInfo(**{**row, "silent_s": float(row["silent_s"])})


def dead_purge(row: Row) -> DeadPurge:
    """The ``dead_purge_preview`` aggregate."""
    return DeadPurge(
        runs=int(row["runs"]),
        tasks=int(row["tasks"]),
        dead_task_ids=tuple(row["dead_task_ids"]),
        released_streams=tuple(row["released_streams"]),
        shown=tuple(row["shown"]),
    )


def tally(found: Sequence[Row], key: str, value: str = "n") -> dict[Any, int]:
    """``{row[key]: row[value]}`` of a ``GROUP BY`` (in the rows' order)."""
    return {row[key]: int(row[value]) for row in found}


def retry_backlog(row: Row | None) -> RetryBacklog:
    """The ``stats_retry_backlog`` aggregate."""
    if row is None:
        return RetryBacklog()
    return RetryBacklog(int(row["n"]), row["next_at"], row["latest_at"])


def poison_candidate(row: Row) -> PoisonCandidate:
    """A ``stats_poison_candidates`` row."""
    return PoisonCandidate(
        id=row["id"],
        run_id=row["run_id"],
        name=row["name"],
        handler=row["handler"],
        state=TaskState(row["state"]),
        attempt=row["attempt"],
        failure_reason=_reason(row["failure_reason"]),
        workflow=row["workflow"],
    )


def outbox_backlog(row: Row | None) -> OutboxBacklog:
    """The ``outbox_backlog`` aggregate."""
    if row is None:
        return OutboxBacklog()
    return OutboxBacklog(int(row["pending"]), float(row["oldest_s"]))


def overview(
    *,
    runs: Sequence[Row],
    tasks: Sequence[Row],
    minutes: Sequence[Row],
    backlog: Row | None,
    poison: Sequence[Row],
    dead: Sequence[Row],
    outbox: Row | None,
    processes: Sequence[Row],
    queues: Sequence[Row] = (),
) -> Overview:
    """The overview from its statements' rows: ``run_state_counts``, ``task_state_counts``,
    ``finished_per_minute``, ``stats_retry_backlog``, ``stats_poison_candidates``,
    ``dead_by_reason``, ``outbox_backlog`` and ``live_processes_by_host``."""
    return Overview(
        runs={**{str(s): 0 for s in RunState}, **tally(runs, "state")},
        tasks={**{str(s): 0 for s in TaskState}, **tally(tasks, "state")},
        finished_per_minute=tuple(
            FinishedMinute(r["minute"], int(r["succeeded"]), int(r["dead"]), int(r["cancelled"]))
            for r in minutes
        ),
        retry_backlog=retry_backlog(backlog),
        poison_candidates=tuple(poison_candidate(r) for r in poison),
        dead_by_reason=tally(dead, "reason"),
        outbox=outbox_backlog(outbox),
        processes=tuple(LiveProcesses(r["host"], r["role"], int(r["n"])) for r in processes),
        queues=queue_loads(queues),
        estimated_runs=estimated(runs),
        estimated_tasks=estimated(tasks),
    )


def estimated(found: Sequence[Row]) -> frozenset[str]:
    """The states of a ``*_state_counts`` result whose count is an estimate."""
    return frozenset(str(r["state"]) for r in found if r["estimated"])


def queue_loads(found: Sequence[Row]) -> tuple[QueueLoad, ...]:
    """``queue_load`` rows."""
    return tuple(
        QueueLoad(r["queue"], int(r["ready"]), int(r["consumers"]), bool(r["estimated"]))
        for r in found
    )


def stats(
    *,
    attempts: Sequence[Row],
    reasons: Sequence[Row],
    backlog: Row | None,
    poison: Sequence[Row],
    dead: Sequence[Row],
    queues: Sequence[Row] = (),
) -> Stats:
    """The stats from their statements' rows: ``stats_attempts``, ``stats_failure_reasons``,
    ``stats_retry_backlog``, ``stats_poison_candidates`` and ``stats_dead_by_workflow``."""
    return Stats(
        attempts=tally(attempts, "attempt"),
        failure_reasons=tally(reasons, "reason"),
        retry_backlog=retry_backlog(backlog),
        poison_candidates=tuple(poison_candidate(r) for r in poison),
        dead=tuple(
            DeadCount(r["workflow"], r["handler"], _reason(r["reason"]), int(r["n"])) for r in dead
        ),
        queues=queue_loads(queues),
        attempts_estimated=any(r["estimated"] for r in attempts),
        dead_newest_only=next((int(r["newest_only"]) for r in dead if r["newest_only"]), None),
    )


# ---------------------------------------------------------------------- objects → parameters


def jsonb(text: JsonText) -> Jsonb:
    """Text :func:`to_json` made, sent as ``jsonb`` without encoding it a second time."""
    return Jsonb(text, dumps=str)


def jsonb_array(texts: Iterable[str]) -> Jsonb:
    """JSON texts as one ``jsonb`` parameter, the array of them (a query reads it back with
    ``jsonb_array_elements ... WITH ORDINALITY``). Not a ``jsonb[]``: psycopg dumps an array
    element by element, escaping each one's quotes and backslashes for the array literal, a
    pass of Python over every byte of every payload; this text goes to the server as is."""
    return jsonb(JsonText("[" + ",".join(texts) + "]"))


def stored_results(results: Iterable[Any]) -> Jsonb:
    """The ``finish`` query's ``results``: each result (checked here unless the worker has: a
    JsonText) as a one-element array, or null for none (:func:`jsonb_array`)."""
    return jsonb_array(
        "null" if r is None else f"[{r if isinstance(r, JsonText) else to_json(r, 'the result')}]"
        for r in results
    )


def task_records(
    tasks: Sequence[PlannedTask], admitted: Sequence[bool] | None = None
) -> dict[str, Jsonb]:
    """``insert_tasks``'s parameter: the tasks as one JSON array of objects, keyed by the
    columns of its ``jsonb_to_recordset``; ``admitted``: which tasks with a concurrency or rate
    key the trigger admitted (limits.admit_new; None: none)."""
    flags = list(admitted) if admitted is not None else [False] * len(tasks)
    return {"tasks": Jsonb([task_record(t, a) for t, a in zip(tasks, flags, strict=True)])}


def task_record(t: PlannedTask, admitted: bool = False) -> dict[str, Any]:
    """One task's object in :func:`task_records` (ids as text: JSON has no uuid)."""
    return {
        "run_id": str(t.run_id),
        "id": str(t.id),
        "name": t.name,
        "handler": t.handler,
        "pending_deps": t.pending,
        "max_attempts": t.max_attempts,
        "base_delay_s": t.base_delay_s,
        "max_delay_s": t.max_delay_s,
        "jitter": t.jitter,
        "timeout_s": t.timeout_s,
        "idempotency_key": t.idempotency_key,
        "ordering_key": t.ordering_key,
        "on_dead": t.on_dead,
        "start_gate": t.start_gate,
        "sleep_s": t.sleep_s,
        "run_if": t.run_if,
        "for_each": t.for_each,
        "max_parallel": t.max_parallel,
        "event_name": t.event_name,
        "event_key": t.event_key,
        "event_timeout_s": t.event_timeout_s,
        "child_workflow": t.child_workflow,
        "queue": t.queue,
        "concurrency_key": t.concurrency_key,
        "concurrency_limit": t.concurrency_limit,
        "rate_key": t.rate_key,
        "rate_limit": t.rate_limit,
        "rate_per_s": t.rate_per_s,
        "admitted": admitted,
        "priority": t.priority,
        "breaker_failures": t.breaker_failures,
        "breaker_window_s": t.breaker_window_s,
        "breaker_cooldown_s": t.breaker_cooldown_s,
        "breaker_key": t.breaker_key,
    }


def claim_params(
    wanted: Sequence[tuple[UUID, int]],
    worker: str,
    lease_s: float,
    local: bool,
    inline: int = DEFAULT_UPSTREAM_INLINE,
) -> dict[str, Any]:
    """The ``claim`` query's parameters for the keyless tasks among (task run, token) pairs;
    ``inline``: the upstream bound (``worker.upstream_inline_items``)."""
    return {
        "inline": inline,
        "ids": [task_run_id for task_run_id, _ in wanted],
        "tokens": [token for _, token in wanted],
        "worker": worker,
        "lease_s": lease_s,
        "local": local,
        "keyless_only": True,
    }


def pair_params(claims: Sequence[tuple[UUID, int]]) -> dict[str, Any]:
    """``ids`` and ``tokens`` of (task run, token) pairs (``release_claims``, ``renew_leases``)."""
    return {"ids": [c[0] for c in claims], "tokens": [c[1] for c in claims]}


def finish_columns(
    outcomes: Sequence[tuple[UUID, int, Finish]], label: str | None = None
) -> dict[str, Any]:
    """The ``finish`` query's parameters: arrays, and the results as one jsonb
    (:func:`stored_results`); the transitions are the caller's to check.

    ``label`` overrides the attempt outcome written (``reused`` for a stored result).
    """
    columns: dict[str, list[Any]] = {
        k: []
        for k in (
            "ids",
            "tokens",
            "states",
            "reasons",
            "errors",
            "tracebacks",
            "outcomes",
            *CAPTURED_COLUMNS,
        )
    }
    for task_run_id, token, finish in outcomes:
        reason = FailureReason.CANCELLED if finish.state is TaskState.CANCELLED else finish.reason
        columns["ids"].append(task_run_id)
        columns["tokens"].append(token)
        columns["states"].append(str(finish.state))
        columns["reasons"].append(None if reason is None else str(reason))
        # free text from handlers: cleaned (NUL, lone surrogates → U+FFFD) and cut, never refused
        error, tb = finish.error, finish.traceback
        columns["errors"].append(None if error is None else clean_text(error, MAX_ERROR_CHARS))
        columns["tracebacks"].append(
            None if tb is None else clean_text(tb, MAX_TRACEBACK_CHARS, keep_end=True)
        )
        columns["outcomes"].append(label or OUTCOMES[finish.state])
        _add_captured(columns, finish.captured)
    return {**columns, "results": stored_results(f.result for _, _, f in outcomes)}


#: The parameter arrays of an attempt's captured output and progress (``finish``,
#: ``write_output``).
CAPTURED_COLUMNS = ("outputs", "dropped", "progress", "messages")


def output_columns(captured: Sequence[tuple[UUID, int, Captured]]) -> dict[str, list[Any]]:
    """The ``write_output`` query's parameter arrays: (task run, token, captured) each."""
    columns: dict[str, list[Any]] = {k: [] for k in ("ids", "tokens", *CAPTURED_COLUMNS)}
    for task_run_id, token, found in captured:
        columns["ids"].append(task_run_id)
        columns["tokens"].append(token)
        _add_captured(columns, found)
    return columns


def _add_captured(columns: dict[str, list[Any]], captured: Captured | None) -> None:
    """Append one attempt's output and progress (NULLs: none) to ``columns``' arrays; the
    domain made them storable text already."""
    output = None if captured is None else captured.output
    progress = None if captured is None else captured.progress
    columns["outputs"].append(None if output is None else output.text)
    columns["dropped"].append(None if output is None else output.dropped)
    columns["progress"].append(None if progress is None else progress.fraction)
    columns["messages"].append(None if progress is None else progress.message)


# ---------------------------------------------------------------- schedules (SPEC 7.2)


def schedule_info(row: Row) -> ScheduleInfo:
    state = "retired" if row["retired_at"] is not None else "paused" if row["paused"] else "active"
    decision = None
    if row["last_outcome"] is not None:
        decision = FireRecord(
            schedule=row["name"],
            fire_time=row["last_decision_fire_time"],
            outcome=row["last_outcome"],
            reason=row["last_reason"],
            manual=row["last_manual"],
            decided_at=row["last_decided_at"],
        )
    return ScheduleInfo(
        name=row["name"],
        workflow=row["workflow"],
        spec=row["spec"],
        state=state,
        next_fire_at=row["next_fire_at"],
        last_fire_at=row["last_fire_at"],
        last_run_id=row["last_run_id"],
        last_run_state=None if row["last_run_state"] is None else RunState(row["last_run_state"]),
        last_decision=decision,
        paused_at=row["paused_at"],
        retired_at=row["retired_at"],
        created_at=row["created_at"],
    )


def fire_record(row: Row) -> FireRecord:
    return FireRecord(
        schedule=row["schedule"],
        fire_time=row["fire_time"],
        outcome=row["outcome"],
        reason=row["reason"],
        last_fire_time=row["last_fire_time"],
        manual=row["manual"],
        run_id=row["run_id"],
        decided_at=row["decided_at"],
    )


def fire_columns(fires: Sequence[tuple[str, Fire, UUID | None]]) -> dict[str, list[Any]]:
    """``insert_fires``'s arrays: (schedule name, decision, the run it creates or None)."""
    return {
        "schedules": [name for name, _, _ in fires],
        "fire_times": [f.fire_time for _, f, _ in fires],
        "last_fire_times": [f.last_fire_time for _, f, _ in fires],
        "outcomes": ["created" if f.created else "skipped" for _, f, _ in fires],
        "reasons": [None if f.reason is None else str(f.reason) for _, f, _ in fires],
        "run_ids": [run_id for _, _, run_id in fires],
    }


def schedule_columns(
    found: Sequence[tuple[str, str, Mapping[str, Any], Any]],
) -> dict[str, list[Any]]:
    """``upsert_schedules``'s arrays: (name, workflow, spec, next fire time) per schedule."""
    return {
        "names": [name for name, _, _, _ in found],
        "workflows": [workflow for _, workflow, _, _ in found],
        "specs": [Jsonb(spec) for _, _, spec, _ in found],
        "next": [next_at for _, _, _, next_at in found],
    }


def event_sent(name: str, key: str, found: Sequence[Row]) -> EventSent:
    """``deliver_event``'s rows (one per woken task, or one with no task) as an
    :class:`EventSent`."""
    first = found[0]
    return EventSent(
        id=first["event_id"],
        name=name,
        key=key,
        created_at=first["created_at"],
        woke=tuple(
            WokenTask(run_id=r["run_id"], task_run_id=r["task_run_id"], task=r["task"])
            for r in found
            if r["task_run_id"] is not None
        ),
    )


def key_task(row: Row, why: str) -> KeyTask:
    """A ``key_stream`` row: a task of an ordering key's stream, with why it holds or waits."""
    return KeyTask(
        id=row["id"],
        run_id=row["run_id"],
        workflow=row["workflow"],
        name=row["name"],
        state=TaskState(row["state"]),
        failure_reason=row["failure_reason"],
        on_dead=row["on_dead"],
        created_at=row["created_at"],
        why=why,
    )


def timeline_task(row: Row, attempts: tuple[Attempt, ...]) -> TimelineTask:
    """A ``timeline_tasks`` row with its latest attempts (``timeline_attempts``)."""
    return TimelineTask(
        id=row["id"],
        name=row["name"],
        handler=row["handler"],
        kind=_task_kind(row),
        state=row["state"],
        attempt=row["attempt"],
        created_at=row["created_at"],
        eligible_at=row["eligible_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        retry_at=row["retry_at"],
        failure_reason=row["failure_reason"],
        map_id=row["map_id"],
        item_index=row["item_index"],
        attempts=attempts,
    )


def _task_kind(row: Row) -> TaskKind:
    """What runs the task: the column that makes it need no worker (architecture.md "Task
    kinds"), else a worker."""
    if row["for_each"] is not None:
        return "map"
    if row["sleep_s"] is not None:
        return "timer"
    if row["event_name"] is not None:
        return "event"
    if row["child_workflow"] is not None:
        return "child"
    return "worker"


def map_rest(row: Row) -> MapRest:
    """A ``timeline_map_rests`` row."""
    return MapRest(
        map_id=row["map_id"],
        n=int(row["n"]),
        counts={state: int(n) for state, n in row["counts"].items()},
        attempts=int(row["attempts"]),
        first_started_at=row["first_started_at"],
        last_finished_at=row["last_finished_at"],
        unfinished_started=int(row["unfinished_started"]),
    )
