"""Statements on whole runs that several parts share, inside the caller's transaction.

The scheduler's ``propagate`` and the operator's cancel and requeue stop runs and derive their
states the same way; these run on the :class:`~flowforge.store.part.Tx` of the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.children import MAX_CHILD_DEPTH
from flowforge.domain.runstate import RunFacts, derive
from flowforge.domain.states import NOT_STARTED_TASK_STATES, CancelCause, TaskState
from flowforge.store.part import Tx


def stop_runs(tx: Tx, run_ids: Sequence[UUID], cause: CancelCause, depth: int = 0) -> None:
    """Cancel the runs' tasks not yet started (and their sleeping timers, waits and running
    child-workflow tasks), ask their running ones to stop; the child runs of the cancelled
    child tasks are cancelled in turn (as an operator's cancel does), down to grandchildren
    (``depth``: the level of ``run_ids`` below the first caller's, a bound on the descent)."""
    transitions.check({*NOT_STARTED_TASK_STATES, TaskState.RUNNING}, TaskState.CANCELLED)
    params = {"run_ids": list(run_ids), "cause": str(cause)}
    cancelled = tx.all("cancel_not_started", params)
    children = sorted({r["child_run_id"] for r in cancelled if r["child_run_id"] is not None})
    stopping = tx.all("request_stop", params)
    if stopping:  # their workers hear it at the commit; lease renewal stays the fallback
        stopped_runs = sorted({row["run_id"] for row in stopping})
        tx.all("notify_cancel", {"run_ids": stopped_runs})
    cancel_child_runs(tx, children, depth + 1)


def cancel_child_runs(tx: Tx, child_run_ids: Sequence[UUID], depth: int) -> None:
    """Cancel the child runs of child-workflow tasks just cancelled or buried, as an operator's
    cancel does (their tasks first, then the runs, level by level; ``depth``: their level below
    the first caller's, a bound on the descent). A child that has finished is left as it ended."""
    if child_run_ids and depth <= MAX_CHILD_DEPTH + 1:
        stop_runs(tx, child_run_ids, CancelCause.OPERATOR, depth)
        asked = tx.all("cancel_child_runs", {"ids": list(child_run_ids)})
        derive_states(tx, [r["id"] for r in asked])


def derive_states(tx: Tx, run_ids: Iterable[UUID]) -> None:
    """Lock the runs (in id order, after their tasks) and store their derived states."""
    ids = sorted(set(run_ids))
    locked = tx.all("lock_runs", {"ids": ids})
    counts: dict[UUID, dict[TaskState, int]] = {r["id"]: {} for r in locked}
    attempted: dict[UUID, bool] = dict.fromkeys(counts, False)
    gated: dict[UUID, bool] = dict.fromkeys(counts, False)
    skipped: dict[UUID, int] = dict.fromkeys(counts, 0)
    for row in tx.all("run_facts", {"ids": ids}):
        counts[row["run_id"]][TaskState(row["state"])] = row["n"]
        skipped[row["run_id"]] += int(row["skipped"])
        attempted[row["run_id"]] = attempted[row["run_id"]] or bool(row["attempted"])
        gated[row["run_id"]] = gated[row["run_id"]] or bool(row["gated"])
    columns: dict[str, list[Any]] = {"ids": [], "states": [], "finished": []}
    for row in locked:
        facts = RunFacts(
            counts[row["id"]],
            attempted[row["id"]],
            row["cancel_requested"],
            start_gate_closed=gated[row["id"]],
            deadline_exceeded=row["deadline_exceeded"],
            skipped=skipped[row["id"]],
        )
        columns["ids"].append(row["id"])
        columns["states"].append(str(derive(facts)))
        columns["finished"].append(facts.finished)
    if columns["ids"]:
        tx.all("update_run_states", columns)
