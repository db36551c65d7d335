"""The worker's statements: claim, finish, renew and release leases.

These are the hot path: most claims and finishes are one statement for a whole batch, one round
trip. Transitions are checked before any SQL runs (an illegal request raises); a lost race
returns LOST / a missing id, never raises.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.breakers import COUNTED_FAILURES
from flowforge.domain.model import (
    DEFAULT_UPSTREAM_INLINE,
    Claim,
    ClaimOutcome,
    ClaimResult,
    Continuation,
    Finish,
    Finished,
)
from flowforge.domain.output import Captured
from flowforge.domain.states import TaskState
from flowforge.errors import IllegalTransitionError, StoreError
from flowforge.store import rows
from flowforge.store.db import Database
from flowforge.store.part import Part, Tx

logger = logging.getLogger(__name__)


class _KeyBusyError(Exception):
    """Internal: roll the claim back because its idempotency key is held elsewhere."""


class Claims(Part):
    """READY → RUNNING → SUCCEEDED / FAILED / CANCELLED, fenced by each task's token.

    ``upstream_inline`` bounds the upstream results a claim carries
    (``worker.upstream_inline_items``; :class:`~flowforge.domain.model.Claim` says how)."""

    def __init__(
        self,
        db: Database,
        rand: Callable[[], float] = random.random,
        *,
        upstream_inline: int = DEFAULT_UPSTREAM_INLINE,
    ) -> None:
        super().__init__(db, rand)
        self.upstream_inline = upstream_inline

    def claim_many(
        self,
        wanted: Sequence[tuple[UUID, int]],
        worker: str,
        lease_s: float,
        key_wait_s: float = 1.0,
        *,
        local: bool = False,
    ) -> list[ClaimResult]:
        """READY → RUNNING for each (task run, token) pair, holding a lease of ``lease_s``.

        Returns one result per pair, in order; a pair named twice executes once (the second
        is LOST). Tasks without an idempotency key are claimed together in one statement. With
        a key: a key that already succeeded finishes the task with the stored result
        (REUSED); a key held by a live execution undoes the claim and defers the task by
        ``key_wait_s`` without using an attempt (DEFERRED). ``local`` marks the claimed
        tasks' pending outbox rows dispatched: the worker took them straight from its own
        finish, so no message needs to go out. A task its handler's circuit breaker or a pause
        holds is not claimed but parked (READY → RETRYING, no attempt used: LOST here; the
        scheduler dispatches it again when nothing holds it).
        """
        transitions.check(TaskState.READY, TaskState.RUNNING)
        transitions.check(TaskState.READY, TaskState.RETRYING)  # parked
        if not wanted:
            return []
        # most tasks have no idempotency key: their claims are one statement, one round trip
        params = rows.claim_params(wanted, worker, lease_s, local, self.upstream_inline)
        found = self._query("claim", params)
        # a claim bumps the token: it answers the pair that named the token before the bump
        claimed = {(row["id"], row["fencing_token"] - 1): rows.claim(row) for row in found}
        results = []
        for task_run_id, token in wanted:
            claim = claimed.pop((task_run_id, token), None)
            if claim is not None:
                results.append(ClaimResult(ClaimOutcome.EXECUTE, claim))
            else:  # keyed, a duplicate, held by the gate, or not READY with that token any more
                results.append(self._claim_keyed(task_run_id, token, worker, lease_s, key_wait_s))
        return results

    def _claim_keyed(
        self, task_run_id: UUID, token: int, worker: str, lease_s: float, key_wait_s: float
    ) -> ClaimResult:
        params = {
            **rows.claim_params(
                [(task_run_id, token)], worker, lease_s, local=False, inline=self.upstream_inline
            ),
            "keyless_only": False,
        }
        try:
            return self._transaction(_claim_with_key, params)
        except _KeyBusyError:
            transitions.check(TaskState.READY, TaskState.RETRYING)
            deferred = self._query(
                "defer", {"id": task_run_id, "token": token, "delay_s": key_wait_s}
            )
            return ClaimResult(ClaimOutcome.DEFERRED if deferred else ClaimOutcome.LOST)

    def release_claims(self, claims: Sequence[tuple[UUID, int]]) -> int:
        """Hand back claims whose handler never started; returns how many.

        The attempt is un-counted. RUNNING → READY with a new outbox row, so the task is
        dispatched again (to any worker); RUNNING → CANCELLED instead when its run asked it to
        stop meanwhile (DEAD ``operator`` when an operator buried it). A pair whose token is no
        longer current is left alone.
        """
        for target in (TaskState.READY, TaskState.CANCELLED, TaskState.DEAD):
            transitions.check(TaskState.RUNNING, target)
        if not claims:
            return 0
        return len(self._query("release_claims", rows.pair_params(claims)))

    def renew_leases(self, claims: Sequence[tuple[UUID, int]], lease_s: float) -> dict[UUID, bool]:
        """Extend every lease still held among ``claims`` by ``lease_s`` (database clock).

        Returns ``{task run id: cancel requested}`` for the leases still held; a pair missing
        from it lost its lease (reaped, or finished elsewhere).
        """
        if not claims:
            return {}
        return rows.held_leases(
            self._query("renew_leases", {**rows.pair_params(claims), "lease_s": lease_s})
        )

    def write_output(self, captured: Sequence[tuple[UUID, int, Captured]]) -> int:
        """Store each (task run, token, captured) running attempt's output and progress so far
        where the token is still current and the task RUNNING; returns how many were written
        (the others finished or were reaped meanwhile)."""
        return len(self._query("write_output", rows.output_columns(captured)))

    def finish_many(
        self,
        outcomes: Sequence[tuple[UUID, int, Finish]],
        offer: int | None = None,
        then: Continuation | None = None,
        queue: str | None = None,
        min_priority: int = 0,
    ) -> Finished:
        """Finish each (task run, token, outcome) whose token is current, in one statement.

        Reports the ids that committed (the others were stale: reaped, or finished elsewhere,
        and are counted as stale completions) and up to ``offer`` (None: all) of the
        dependents the successes made READY on ``queue`` (the finishing worker's; None: only
        those on no queue) at ``min_priority`` or above (a reserved worker's): a dependent
        bound for another queue, or below that priority, goes out as a message, to be run by
        that queue's (that band's) workers. With ``then``, the same transaction also claims
        the first ``then.limit`` of those (keyless ones; see :meth:`claim_many` with
        ``local``): their outbox rows are stamped before any publisher can see them, so the
        next step of a chain cannot be published and claimed by another worker first.

        A success of a run whose definition has that one task (the run RUNNING, not asked to
        stop, not a child run, the task without a key) settles the run SUCCEEDED in the same
        statement, and no scheduler pass sees it (docs/architecture.md, "A finish settles a
        one-task run").
        """
        if not outcomes:
            return Finished(frozenset(), ())
        transitions.check(TaskState.PENDING, TaskState.READY)  # dependents released
        params = _finish_params(outcomes, offer=offer, queue=queue, min_priority=min_priority)
        # handler failures count against their handler's circuit breaker, in this transaction:
        # only a batch with one pays for it (domain/breakers.py)
        broke = [
            tid
            for tid, _, finish in outcomes
            if finish.state is TaskState.FAILED and finish.reason in COUNTED_FAILURES
        ]
        continuing = then is not None and then.limit > 0
        if not broke and not continuing:
            finished = rows.finished(self._query("finish", params))
        else:
            if continuing:
                transitions.check(TaskState.READY, TaskState.RUNNING)
                # the publisher hears only of what the continuation leaves (_finish_then_claim)
                params["publish"] = False
            finished = self._transaction(
                _finish_then_claim, params, then, broke, self.upstream_inline
            )
        stale = len(outcomes) - len(finished.committed)
        if stale:  # rare: counted once the finish committed, in a statement of its own
            self._count_stale(stale)
        return finished

    def _count_stale(self, stale: int) -> None:
        """Count ``stale`` outcomes of a finish that committed. Best effort: should the
        database fail now, raising would make the caller take the committed finish for a
        failed one and send it again (every outcome then stale); a lost count is only a
        counter's (the worker's own metric counts them too)."""
        try:
            self._query("count_stale_completions", {"n": stale})
        except StoreError as exc:
            logger.warning(
                "could not count %d stale completion(s): %s",
                stale,
                exc,
                extra={"action": "stale_count_failed"},
            )


def _claim_with_key(tx: Tx, params: dict[str, Any]) -> ClaimResult:
    row = tx.one("claim", params)
    if row is None:  # not READY with that token, or held by the gate: then parked (no attempt)
        tx.all("park", {"id": params["ids"][0], "token": params["tokens"][0]})
        return ClaimResult(ClaimOutcome.LOST)
    claim = rows.claim(row)
    if claim.idempotency_key is None:
        return ClaimResult(ClaimOutcome.EXECUTE, claim)
    key_params = {
        "key": claim.idempotency_key,
        "id": claim.task_run_id,
        "token": claim.fencing_token,
        "lease_s": params["lease_s"],
    }
    if tx.one("acquire_key", key_params):
        return ClaimResult(ClaimOutcome.EXECUTE, claim)
    held = tx.one("read_key", key_params)
    if held is None or held["state"] != TaskState.SUCCEEDED:
        raise _KeyBusyError
    reused = Finish(TaskState.SUCCEEDED, result=held["result"])
    tx.all("finish", _finish_params([(claim.task_run_id, claim.fencing_token, reused)], "reused"))
    return ClaimResult(ClaimOutcome.REUSED, claim)


def _finish_then_claim(
    tx: Tx,
    params: dict[str, Any],
    then: Continuation | None,
    broke: Sequence[UUID],
    inline: int,
) -> Finished:
    finished = rows.finished(tx.all("finish", params))
    counted = [tid for tid in broke if tid in finished.committed]  # not a stale outcome's
    if counted:
        tx.all("trip_breakers", {"ids": counted})
    if then is None or then.limit <= 0:
        return finished
    wanted = finished.ready[: then.limit]
    claimed: tuple[Claim, ...] = ()
    if wanted:
        found = tx.all("claim", rows.claim_params(wanted, then.worker, then.lease_s, True, inline))
        claimed = tuple(rows.claim(row) for row in found)
    # a dependent this worker did not take (another queue, a key, past the limit, held by the
    # gate) goes out as a message: the publisher is told, in this transaction
    if finished.unpublished > len(claimed):
        tx.all("notify_outbox")
    return replace(finished, claimed=claimed, unpublished=0)


def _finish_params(
    outcomes: Sequence[tuple[UUID, int, Finish]],
    label: str | None = None,
    *,
    offer: int | None = 0,
    queue: str | None = None,
    min_priority: int = 0,
) -> dict[str, Any]:
    """Every parameter of the ``finish`` query, each transition checked first: the outcomes'
    columns and what the finishing worker is offered (``offer`` dependents on ``queue`` at
    ``min_priority`` or above; by default none). One place, so a caller cannot miss one."""
    for _, _, finish in outcomes:
        transitions.check(TaskState.RUNNING, finish.state)
        if finish.state not in rows.OUTCOMES:
            raise IllegalTransitionError(
                f"finish writes SUCCEEDED, FAILED or CANCELLED, not {finish.state} (the reaper's)"
            )
        if finish.state is TaskState.FAILED and finish.reason is None:
            raise ValueError("a failure needs a reason")
    columns = rows.finish_columns(outcomes, label)
    return {
        **columns,
        "offer": offer,
        "queue": queue,
        "min_priority": min_priority,
        "publish": True,
    }
