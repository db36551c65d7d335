"""The scheduler's passes: promote, re-dispatch, route failures, reap leases, propagate, retain.

Each pass is one transaction over a bounded batch (``limit``). The legality of each transition
is checked before any SQL runs; retry arithmetic happens in SQL on the database clock, and the
retry policy (:func:`~flowforge.domain.policy.decide`) only decides *how long*.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from flowforge.domain import conditions, transitions
from flowforge.domain.model import Routed
from flowforge.domain.policy import (
    DEFAULT_CRASH_LOOP_THRESHOLD,
    Bury,
    Cancel,
    Decision,
    FailureFacts,
    Retry,
    decide,
)
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import NOT_STARTED_TASK_STATES, CancelCause, TaskState
from flowforge.store import rows
from flowforge.store.part import Part, Tx
from flowforge.store.runs import derive_states, stop_runs

logger = logging.getLogger(__name__)

#: Told each task a routing or reaping pass committed (after the commit, once per task).
Observer = Callable[[Routed], None]
#: The statements of a policy pass: (lock the candidates, apply the decisions).
_ROUTING = ("lock_failed", "apply_routing")
_REAPING = ("lock_expired_leases", "apply_reap")


class Passes(Part):
    """The scheduler's state changes, each a bounded batch in one transaction."""

    def promote_ready(self, limit: int) -> int:
        """PENDING (dependencies met, stream free) and due RETRYING → READY + outbox row."""
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.READY)
        return self._transaction(_promote, limit)

    def redispatch_lost(self, age_s: float, limit: int) -> int:
        """READY tasks whose confirmed message the broker lost get a new dispatch generation.

        Lost means: published more than ``age_s`` seconds ago and never claimed, while a
        dispatch published after it has been claimed already. Returns how many were re-queued.
        """
        transitions.check(TaskState.READY, TaskState.READY)
        found = self._query("redispatch_lost", {"age_s": age_s, "limit": limit})
        queued = int(found[0]["queued"]) if found else 0
        if queued:
            logger.warning(
                "re-dispatched %d READY task(s) whose message the broker lost",
                queued,
                extra={"action": "redispatched"},
            )
        return queued

    def route_failed(
        self,
        limit: int,
        crash_loop_threshold: int = DEFAULT_CRASH_LOOP_THRESHOLD,
        observe: Observer | None = None,
    ) -> int:
        """FAILED → RETRYING / DEAD / CANCELLED by each task's retry policy.

        Returns how many were routed; ``observe`` is told each one (the scheduler logs them).
        """
        policy = _Policy(TaskState.FAILED, _ROUTING, rows.failure_facts, crash_loop_threshold)
        return self._observed(self._transaction(policy.apply, limit, self._rand), observe)

    def reap_expired(
        self,
        limit: int,
        crash_loop_threshold: int = DEFAULT_CRASH_LOOP_THRESHOLD,
        observe: Observer | None = None,
    ) -> int:
        """RUNNING with a lapsed lease → RETRYING / DEAD (crash loop) / CANCELLED, token bumped.

        Returns how many were reaped; ``observe`` is told each one (the scheduler logs them).
        """
        policy = _Policy(TaskState.RUNNING, _REAPING, _expiry_facts, crash_loop_threshold)
        return self._observed(self._transaction(policy.apply, limit, self._rand), observe)

    def propagate(self, limit: int) -> int:
        """Apply the consequences of tasks that finished (SUCCEEDED / DEAD / CANCELLED).

        (Success released the dependents already, in the finishing statement.) Death or
        cancellation cancels the dependents that can no longer run (and, for a fail-fast run,
        every task not yet started while running siblings are asked to stop). The runs
        involved have their state derived anew.
        """
        transitions.check(TaskState.PENDING, TaskState.CANCELLED)
        return self._transaction(_propagate, limit)

    def evaluate_conditions(self, limit: int) -> int:
        """Conditional (``run_if``) tasks whose dependencies all finished: the condition holds
        → the gate opens (``promote_ready`` makes them READY), it cannot → PENDING → CANCELLED,
        cause ``condition_not_met`` (a skip). One transaction; a task is decided once, whoever
        races or dies (the apply names the gate it locked). Returns how many were decided."""
        transitions.check(TaskState.PENDING, TaskState.CANCELLED)
        return self._transaction(_evaluate, limit)

    def start_due_runs(self, limit: int) -> int:
        """SCHEDULED runs whose start time has come (``start_at <= now()``, the database's
        clock) leave SCHEDULED with their start gates open, for the promote pass to make their
        root tasks READY. Returns how many runs started; each starts once, whoever races."""
        transitions.check(TaskState.PENDING, TaskState.READY)  # what the opened gates lead to
        started = self._transaction(_start_due, limit)
        if started:  # after the commit: a retried transaction logs once
            logger.info(
                "started %d delayed run(s) whose start time came",
                started,
                extra={"action": "runs_started"},
            )
        return started

    def start_timers(self, limit: int) -> int:
        """Durable timers whose dependencies are met: PENDING → RUNNING with a wake time (the
        database's now + their sleep), no lease, no outbox row. Returns how many."""
        transitions.check(TaskState.PENDING, TaskState.RUNNING)
        found = self._query("start_timers", {"limit": limit})
        return int(found[0]["n"]) if found else 0

    def wake_timers(self, limit: int) -> int:
        """Sleeping timers whose wake time has come: RUNNING → SUCCEEDED, dependents released
        as a finish releases them. Returns how many woke."""
        transitions.check(TaskState.RUNNING, TaskState.SUCCEEDED)
        return self._transaction(_wake, limit)

    def expire_deadlines(self, limit: int) -> int:
        """Unfinished runs past their deadline: tasks not started (and sleeping timers)
        CANCELLED, running ones asked to stop (``ctx.cancelled``), the run marked
        ``deadline_exceeded`` — it ends FAILED once nothing of it runs. Returns how many runs
        this pass ended (a run an operator cancelled first is left to the cancellation)."""
        transitions.check({*NOT_STARTED_TASK_STATES, TaskState.RUNNING}, TaskState.CANCELLED)
        ended: list[UUID] = self._transaction(_expire, limit)
        if ended:  # after the commit
            logger.warning(
                "%d run(s) exceeded their deadline (FAILED, deadline_exceeded): %s",
                len(ended),
                ", ".join(str(rid) for rid in ended[:10]),
                extra={"action": "deadline_exceeded"},
            )
        return len(ended)

    def next_due_s(self, workflows: Sequence[str] = ()) -> float | None:
        """Seconds until the earliest start time, timer wake-up, deadline or fire time of a
        schedule of ``workflows`` still to act on (by the database clock; <= 0 when one is due
        now), None when nothing waits."""
        found = self._query("next_due", {"workflows": list(workflows)})
        value = found[0]["due_in_s"] if found else None
        return None if value is None else float(value)

    def purge(self, age_s: float, limit: int, *, key_age_s: float | None = None) -> int:
        """Retention: delete up to ``limit`` each of finished runs, published outbox rows,
        logged breaker transitions and gate audit rows older than ``age_s``, keyed breakers
        closed, without failures in their window and unchanged for ``age_s``, and SUCCEEDED
        idempotency keys unused for ``key_age_s`` (seconds; None leaves keys alone); returns
        the rows deleted. A run with a DEAD (or any unsettled) task is never deleted, nor a
        breaker transition not logged yet, nor a handler's own breaker or one not closed."""
        ages = {
            "purge_runs": age_s,
            "purge_outbox": age_s,
            "purge_keys": key_age_s,
            "purge_gate_audit": age_s,
            "purge_breaker_transitions": age_s,
            "purge_idle_breakers": age_s,  # after the transitions: it needs theirs gone
        }
        return self._transaction(_purge, ages, limit)

    @staticmethod
    def _observed(outcomes: list[Routed], observe: Observer | None) -> int:
        if observe is not None:  # after the commit: a retried transaction counts once
            for routed in outcomes:
                observe(routed)
        return len(outcomes)


def _expiry_facts(row: Mapping[str, Any]) -> FailureFacts:
    return rows.failure_facts(row, lease_expired=True)


def _promote(tx: Tx, limit: int) -> int:
    row = tx.one("promote_ready", {"limit": limit})
    promoted, queued = (row["promoted"], row["queued"]) if row else (0, 0)
    if queued:
        tx.all("notify_outbox")
    return int(promoted)


class _Policy:
    """One policy pass: lock a batch in ``source``, decide each, apply the decisions."""

    def __init__(
        self,
        source: TaskState,
        statements: tuple[str, str],
        facts: Callable[[Mapping[str, Any]], FailureFacts],
        crash_loop_threshold: int,
    ) -> None:
        self._source = source
        self._lock, self._apply = statements
        self._facts = facts
        self._threshold = crash_loop_threshold

    def apply(self, tx: Tx, limit: int, rand: Callable[[], float]) -> list[Routed]:
        locked = tx.all(self._lock, {"limit": limit})
        if not locked:
            return []
        columns: dict[str, list[Any]] = {
            k: [] for k in ("ids", "tokens", "states", "delays", "reasons")
        }
        for row in locked:
            row_facts = self._facts(row)
            decision = decide(rows.retry_policy(row), row_facts, rand, self._threshold)
            state, delay, reason = _decision_columns(decision, row_facts.reason)
            transitions.check(self._source, state)
            for key, value in zip(
                columns,
                (row["id"], row["fencing_token"], str(state), delay, str(reason)),
                strict=True,
            ):
                columns[key].append(value)
        changed = tx.all(self._apply, columns)
        if changed:
            tx.all("notify_scheduler")
        decided = {
            task_id: (delay, reason)
            for task_id, delay, reason in zip(
                columns["ids"], columns["delays"], columns["reasons"], strict=True
            )
        }
        return [rows.routed(row, self._source, *decided[row["id"]]) for row in changed]


def _propagate(tx: Tx, limit: int) -> int:
    finished = tx.all("lock_unpropagated", {"limit": limit})
    if not finished:
        return 0
    ended = [r["id"] for r in finished if r["state"] != TaskState.SUCCEEDED]
    fail_fast = sorted(
        {r["run_id"] for r in finished if r["state"] == TaskState.DEAD and r["fail_fast"]}
    )
    if ended:
        tx.all("cancel_dependents", {"ids": ended})
        tx.all("release_conditions", {"ids": ended})
    if fail_fast:
        stop_runs(tx, fail_fast, CancelCause.UPSTREAM)
    tx.all("mark_propagated", {"ids": [r["id"] for r in finished]})
    # A death or cancellation always changes the run; a success only when it was the last
    # unfinished task (or the run is not RUNNING yet): deriving a big run after every batch of
    # successes would read all its tasks again and again.
    changed = {r["run_id"] for r in finished if r["state"] != TaskState.SUCCEEDED}
    succeeded_only = sorted({r["run_id"] for r in finished} - changed)
    if succeeded_only:
        changed |= {row["id"] for row in tx.all("runs_to_derive", {"ids": succeeded_only})}
    derive_states(tx, changed)
    return len(finished)


def _evaluate(tx: Tx, limit: int) -> int:
    locked = tx.all("lock_conditions", {"limit": limit})
    verdicts = {row["id"]: conditions.decide(row["run_if"], row["upstream"]) for row in locked}
    decided = {tid: str(v) for tid, v in verdicts.items() if v is not conditions.Verdict.WAIT}
    if not decided:
        return 0
    applied = tx.all("apply_conditions", {"ids": list(decided), "verdicts": list(decided.values())})
    if applied:
        tx.all("notify_scheduler")  # a skip to propagate, a gate opened to promote
    return len(applied)


def _start_due(tx: Tx, limit: int) -> int:
    row = tx.one("start_due_runs", {"limit": limit})
    return int(row["started"]) if row else 0


def _wake(tx: Tx, limit: int) -> int:
    row = tx.one("wake_timers", {"limit": limit})
    woke, queued = (int(row["woke"]), int(row["queued"])) if row else (0, 0)
    if queued:
        tx.all("notify_outbox")
    return woke


def _expire(tx: Tx, limit: int) -> list[UUID]:
    overdue = [r["id"] for r in tx.all("overdue_runs", {"limit": limit})]
    if not overdue:
        return []
    stop_runs(tx, overdue, CancelCause.DEADLINE)  # task rows first, then the runs
    ended = [r["id"] for r in tx.all("mark_deadline_exceeded", {"ids": overdue})]
    derive_states(tx, ended)
    return ended


def _purge(tx: Tx, ages: Mapping[str, float | None], limit: int) -> int:
    return sum(
        tx.count(name, {"age_s": age, "limit": limit})
        for name, age in ages.items()
        if age is not None
    )


def _decision_columns(
    decision: Decision, retry_reason: FailureReason
) -> tuple[TaskState, float, FailureReason]:
    """(target state, delay in seconds, reason to store) for a routing decision."""
    if isinstance(decision, Retry):
        return TaskState.RETRYING, decision.delay, retry_reason
    if isinstance(decision, Bury):
        return TaskState.DEAD, 0.0, decision.reason
    assert isinstance(decision, Cancel)
    return TaskState.CANCELLED, 0.0, FailureReason.CANCELLED
