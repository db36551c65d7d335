"""Operator actions: cancel a run, requeue dead tasks, purge old dead ones.

Each action is audited or logged; a requeue is one transaction per task (a bulk requeue is many
of them), so a failure part-way leaves every task either requeued and audited or untouched.
Actions answer with the read model after (:class:`~flowforge.store.reads.Reads`), read in the
action's own transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.model import (
    BulkRequeue,
    DeadFilter,
    DeadPurge,
    Rerun,
    Run,
    TaskRun,
    parse_id,
)
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.domain.values import MAX_NOTE_BYTES, check_note, check_text
from flowforge.errors import NotDeadError, NotFinishedError, NotFoundError
from flowforge.store import rows
from flowforge.store.part import Tx
from flowforge.store.reads import Reads, dead_params, run_with_tasks, task_by_id, text_filter
from flowforge.store.runs import derive_states, stop_runs

logger = logging.getLogger(__name__)


class Operator(Reads):
    """What an operator changes by hand (CLI, API)."""

    def cancel_run(self, run_id: UUID | str) -> Run:
        """Cancel what has not started, ask running tasks to stop; return the run after."""
        return self._transaction(_cancel, parse_id(run_id, "run id"))

    def requeue_dead(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> TaskRun:
        """DEAD → PENDING with a fresh retry budget, recorded in the audit table.

        Tasks of the same run that were cancelled only because this one died come back too.
        """
        tid = parse_id(task_run_id, "task run id")
        _check_requeue(requested_by, reason)
        task = self._transaction(_requeue_and_read, tid, requested_by, reason)
        _log_requeued(tid)
        return task

    def requeue_dead_matching(
        self,
        match: DeadFilter,
        requested_by: str,
        reason: str | None,
        limit: int,
        dry_run: bool = False,
    ) -> BulkRequeue:
        """Requeue up to ``limit`` dead tasks matching ``match``, newest first.

        Each one goes through the single requeue (:meth:`requeue_dead`'s transaction and audit
        row with ``reason``), so a failure part-way leaves every task either requeued and
        audited or untouched. A task no longer DEAD when its turn comes is skipped. A dry run
        only counts the matches.
        """
        _check_requeue(requested_by, reason)
        matched, ids = self._transaction(_matching_dead, dead_params(match), limit, dry_run)
        if dry_run:
            return BulkRequeue(matched, limit, dry_run=True)
        requeued: list[UUID] = []
        skipped: list[UUID] = []
        for tid in ids:  # one transaction each (see the module docstring)
            try:
                self._transaction(_requeue, tid, requested_by, reason)
            except (NotDeadError, NotFoundError):
                skipped.append(tid)  # requeued or purged by someone else meanwhile
            else:
                _log_requeued(tid)
                requeued.append(tid)
        logger.info(
            "bulk requeue: %d of %d matching dead task(s) requeued, %d skipped",
            len(requeued),
            matched,
            len(skipped),
            extra={"action": "tasks_requeued"},
        )
        return BulkRequeue(matched, limit, False, tuple(requeued), tuple(skipped))

    def rerun(
        self,
        run_id: UUID | str,
        requested_by: str,
        reason: str | None = None,
        from_task: str | None = None,
    ) -> Rerun:
        """Run a finished run again from its DEAD and CANCELLED tasks (and, with
        ``from_task``, from that task too), with everything downstream of them: they go back
        to PENDING with a fresh retry budget; SUCCEEDED tasks upstream keep their results.
        One transaction with its ``rerun_audit`` row (who, when, why, which tasks).

        Refused (nothing changed): :class:`NotFoundError` for an unknown run or a
        ``from_task`` the run has no task of that name, :class:`NotFinishedError` for a run
        that is not finished (or with nothing to rerun).
        """
        rid = parse_id(run_id, "run id")
        transitions.check(
            (TaskState.SUCCEEDED, TaskState.DEAD, TaskState.CANCELLED), TaskState.PENDING
        )
        check_note(requested_by, reason, "the rerun reason")
        if from_task is not None:
            check_text(from_task, "the task to rerun from", MAX_NOTE_BYTES)
        rerun = self._transaction(_rerun, rid, requested_by, reason, from_task)
        logger.info(
            "rerun of run %s by %r: %d task(s) reset (%s)",
            rid,
            requested_by,
            len(rerun.task_names),
            ", ".join(rerun.task_names[:10]),
            extra={"action": "run_rerun"},
        )
        return rerun

    def purge_dead(
        self, age_s: float, requested_by: str, limit: int, workflow: str | None = None
    ) -> DeadPurge:
        """Delete one batch (up to ``limit`` runs) of DEAD tasks that died over ``age_s``
        seconds ago (by the database clock), of ``workflow`` or of all, with their runs.

        A run goes whole — tasks, attempts, edges, outbox rows, requeue audit — and only when
        nothing else in it is unsettled (every other task SUCCEEDED, CANCELLED or as old and
        DEAD); an old DEAD task in a run that can still change is kept. Idempotency keys stay.
        The batch is one transaction that locks the runs' tasks, so a racing requeue either
        wins (the run is kept) or waits; it writes a ``purge_audit`` row and wakes the
        scheduler, since a released ``on_dead: block`` stream's next task can now run. An empty
        result means nothing (more) to purge.
        """
        check_text(requested_by, "requested_by", MAX_NOTE_BYTES)
        text_filter(workflow, "workflow")
        purged = self._transaction(_purge_dead, age_s, requested_by, limit, workflow)
        if purged.runs:
            logger.warning(
                "purged %d run(s) with %d dead task(s) older than %.0fs (by %r, workflow %r); "
                "released %d ordering stream(s)",
                purged.runs,
                len(purged.dead_task_ids),
                age_s,
                requested_by,
                workflow,
                len(purged.released_streams),
                extra={"action": "dead_purged"},
            )
        return purged

    def preview_dead_purge(
        self, age_s: float, workflow: str | None = None, show: int = 100
    ) -> DeadPurge:
        """What :meth:`purge_dead` would delete in all its batches together, changing nothing;
        ``shown`` lists up to ``show`` of the dead tasks, oldest death first."""
        text_filter(workflow, "workflow")
        params = {"age_s": age_s, "workflow": workflow, "only": None, "limit": None}
        return self._transaction(_preview, params, show)

    def count_old_dead(self, age_s: float, workflow: str | None = None) -> int:
        """DEAD tasks that died over ``age_s`` seconds ago (of ``workflow`` or of all)."""
        text_filter(workflow, "workflow")
        found = self._query("count_old_dead", {"age_s": age_s, "workflow": workflow})
        return int(found[0]["n"])


def _check_requeue(requested_by: str, reason: str | None) -> None:
    """The transitions of a requeue, and what the operator wrote for the audit, refused (never
    altered) before any change if PostgreSQL text could not hold it: NUL, a lone surrogate,
    over MAX_NOTE_BYTES."""
    transitions.check(TaskState.DEAD, TaskState.PENDING)
    transitions.check(TaskState.CANCELLED, TaskState.PENDING)  # its collateral cancellations
    check_note(requested_by, reason, "the requeue reason")


def _log_requeued(tid: UUID) -> None:
    """After the commit: a retried transaction logs once."""
    logger.info("requeued dead task run %s", tid, extra={"action": "task_requeued"})


def _cancel(tx: Tx, rid: UUID) -> Run:
    stop_runs(tx, [rid], CancelCause.OPERATOR)
    if tx.one("mark_run_cancel_requested", {"id": rid}) is None:
        raise NotFoundError(f"no run with id {rid}")
    derive_states(tx, [rid])
    tx.all("notify_scheduler")
    return run_with_tasks(tx, rid)


def _matching_dead(
    tx: Tx, params: Mapping[str, Any], limit: int, dry_run: bool
) -> tuple[int, list[UUID]]:
    row = tx.one("count_dead", params)
    matched = int(row["n"]) if row else 0
    if dry_run or not matched:
        return matched, []
    return matched, [r["id"] for r in tx.all("dead_ids_matching", {**params, "limit": limit})]


def _requeue_and_read(tx: Tx, tid: UUID, requested_by: str, reason: str | None) -> TaskRun:
    _requeue(tx, tid, requested_by, reason)
    return task_by_id(tx, tid)


def _requeue(tx: Tx, tid: UUID, requested_by: str, reason: str | None) -> None:
    """One dead task → PENDING with its audit row (and its run's collateral cancellations)."""
    current = tx.one("task_state", {"id": tid})
    if current is None:
        raise NotFoundError(f"no task run with id {tid}")
    if current["state"] != TaskState.DEAD:
        raise NotDeadError(f"task run {tid} is {current['state']}, not DEAD: nothing to requeue")
    row = tx.one("requeue_dead", {"id": tid})
    if row is None:  # it changed since we looked: report it like any other non-dead task
        raise NotDeadError(f"task run {tid} is no longer DEAD: nothing to requeue")
    # a map comes back with its dead items, an item with its dead map (no-ops for other tasks)
    tx.all("requeue_map_items", {"id": tid})
    tx.all("reopen_map", {"id": tid})
    revived = tx.all("revive_cancelled", {"run_id": row["run_id"], "id": tid})
    # conditional (run_if) dependents counted these as finished: they wait for them again
    tx.all("regate_conditions", {"ids": [tid, *(r["id"] for r in revived)]})
    tx.all(
        "insert_audit",
        {
            "id": tid,
            "by": requested_by,
            "reason": reason,
            "previous_reason": current["failure_reason"],
            "attempt": current["attempt"],
        },
    )
    derive_states(tx, [row["run_id"]])
    tx.all("notify_scheduler")


def _rerun(
    tx: Tx, rid: UUID, requested_by: str, reason: str | None, from_task: str | None
) -> Rerun:
    """Task rows first, then the run (the order every writer uses)."""
    tx.all("lock_run_tasks", {"ids": [rid]})
    run = tx.one("lock_rerun", {"id": rid})
    if run is None:
        raise NotFoundError(f"no run with id {rid}")
    if not run["finished"]:
        raise NotFinishedError(
            f"run {rid} is {run['state']}, not finished: only a finished run can be rerun "
            "(cancel it first, or wait)"
        )
    if from_task is not None:
        known = {r["name"] for r in tx.all("run_task_names", {"id": rid})}
        if from_task not in known:
            raise NotFoundError(f"run {rid} has no task named {from_task!r}")
    reset = tx.all("rerun_tasks", {"id": rid, "from_task": from_task})
    if not reset:
        raise NotFinishedError(
            f"run {rid} is {run['state']} with no failed or cancelled task: nothing to rerun "
            "(name a task with --from to run it and what follows again)"
        )
    ids = [r["id"] for r in reset]
    names = [r["name"] for r in reset]
    tx.all("reopen_run", {"id": rid})
    tx.all(
        "insert_rerun_audit",
        {
            "id": rid,
            "by": requested_by,
            "reason": reason,
            "from_task": from_task,
            "previous_state": run["state"],
            "task_run_ids": ids,
            "task_names": names,
        },
    )
    derive_states(tx, [rid])
    tx.all("notify_scheduler")
    return Rerun(run_with_tasks(tx, rid), tuple(ids), tuple(names), RunState(run["state"]))


def _purge_dead(
    tx: Tx, age_s: float, requested_by: str, limit: int, workflow: str | None
) -> DeadPurge:
    select = {"age_s": age_s, "workflow": workflow}
    ids: list[UUID] = []
    while not ids:
        ids = _purgeable(tx, {**select, "only": None, "limit": limit})
        if not ids:
            return DeadPurge()
        tx.all("lock_run_tasks", {"ids": ids})
        # a requeue may have committed while we waited: look again, under the locks (a run
        # that no longer qualifies cannot qualify again in this transaction: its cutoff is
        # fixed at the transaction's now())
        ids = _purgeable(tx, {**select, "only": ids, "limit": None})
    preview = _dead_purge_preview(tx, ids, show=0)
    tx.all(
        "delete_purged_runs",
        {
            "ids": ids,
            "by": requested_by,
            "age_s": age_s,
            "workflow": workflow,
            "tasks": preview.tasks,
            "dead_task_ids": list(preview.dead_task_ids),
            "released_streams": list(preview.released_streams),
        },
    )
    return preview


def _preview(tx: Tx, params: Mapping[str, Any], show: int) -> DeadPurge:
    return _dead_purge_preview(tx, _purgeable(tx, params), show)


def _purgeable(tx: Tx, params: Mapping[str, Any]) -> list[UUID]:
    return [r["id"] for r in tx.all("purgeable_dead_runs", params)]


def _dead_purge_preview(tx: Tx, ids: Sequence[UUID], show: int) -> DeadPurge:
    row = tx.one("dead_purge_preview", {"ids": list(ids), "show": show})
    assert row is not None  # an aggregate always answers one row
    return rows.dead_purge(row)
