"""The repository: the one owner of every query FlowForge runs.

Each public method is one transaction. State changes are the conditional statements of
``queries.sql``; the legality of each requested transition is checked here *before* any SQL
runs (an illegal request raises, a lost race returns False / LOST). All lease and retry
arithmetic happens in SQL on the database clock; this module only decides *how long*.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from flowforge.domain import transitions
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import (
    Attempt,
    BulkRequeue,
    Claim,
    ClaimOutcome,
    ClaimResult,
    Continuation,
    DeadFilter,
    DeadPurge,
    DeadTask,
    Dispatch,
    Finish,
    Finished,
    ProcessInfo,
    Renewal,
    Routed,
    Run,
    TaskDetail,
    TaskRun,
    TriggerResult,
    parse_id,
)
from flowforge.domain.plan import RunPlan, plan_runs
from flowforge.domain.policy import (
    DEFAULT_CRASH_LOOP_THRESHOLD,
    Bury,
    Cancel,
    Decision,
    FailureFacts,
    Jitter,
    Retry,
    RetryPolicy,
    decide,
)
from flowforge.domain.reasons import FailureReason
from flowforge.domain.runstate import RunFacts, derive
from flowforge.domain.states import NOT_STARTED_TASK_STATES, CancelCause, RunState, TaskState
from flowforge.domain.values import (
    MAX_ERROR_CHARS,
    MAX_NOTE_BYTES,
    MAX_TRACEBACK_CHARS,
    JsonText,
    check_text,
    clean_text,
    to_json,
)
from flowforge.errors import (
    IllegalTransitionError,
    NotDeadError,
    NotFoundError,
    TriggerConflictError,
)
from flowforge.store import queries, rows
from flowforge.store.db import Cursor, Database

logger = logging.getLogger(__name__)

#: Advisory-lock namespace for ordering keys (the second int is hashtext(key)).
ORDERING_LOCK_NAMESPACE = 0x4F52  # "OR"
#: Told each task a routing or reaping pass committed (after the commit, once per task).
Observer = Callable[[Routed], None]
_OUTCOMES = {
    TaskState.SUCCEEDED: "succeeded",
    TaskState.FAILED: "failed",
    TaskState.CANCELLED: "cancelled",
}


class _KeyBusyError(Exception):
    """Internal: roll the claim back because its idempotency key is held elsewhere."""


class Repository:
    """Every read and state change of runs and task runs.

    ``rand`` (a float in [0, 1)) feeds retry jitter; tests inject a fixed one.
    """

    def __init__(self, db: Database, rand: Callable[[], float] = random.random) -> None:
        self._db = db
        self._q = queries.load()
        self._rand = rand

    # ------------------------------------------------------------------ triggering

    def trigger(
        self,
        workflow: WorkflowDef,
        run_input: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> TriggerResult:
        """Create a run and its task runs in one transaction.

        The same ``idempotency_key`` returns the same run (``created`` False); the same key
        with another workflow or input raises :class:`TriggerConflictError`.
        """
        return self.trigger_many(workflow, [run_input], [idempotency_key])[0]

    def trigger_many(
        self,
        workflow: WorkflowDef,
        inputs: Sequence[Mapping[str, Any] | None],
        idempotency_keys: Sequence[str | None] | None = None,
    ) -> list[TriggerResult]:
        """Create one run per input in one transaction (a few array inserts, not one per run).

        Results are in input order; idempotency keys behave as in :meth:`trigger`, and one
        conflict fails the whole batch.
        """
        plan = plan_runs(workflow, inputs, idempotency_keys)
        if not plan.run_ids:
            return []
        return self._db.run(self._insert_plan, workflow, plan)

    def _insert_plan(
        self, cur: Cursor, workflow: WorkflowDef, plan: RunPlan
    ) -> list[TriggerResult]:
        q = self._q
        cur.execute(
            q["register_definition"],
            {
                "name": workflow.name,
                "digest": workflow.digest,
                "definition": Jsonb(workflow.to_dict()),
            },
        )
        ordering = plan.ordering_keys()
        if ordering:
            cur.execute(
                q["lock_ordering_keys"], {"namespace": ORDERING_LOCK_NAMESPACE, "keys": ordering}
            )
        rows = cur.execute(
            q["insert_runs"],
            {
                "ids": plan.run_ids,
                "workflow": workflow.name,
                "digest": workflow.digest,
                "inputs": [_jsonb(i) for i in plan.inputs],
                "fail_fast": workflow.fail_fast,
                "keys": plan.keys,
                "digests": plan.digests,
            },
        ).fetchall()
        inserted = {r["id"] for r in rows}
        results = [TriggerResult(rid, created=True) for rid in plan.run_ids]
        if len(inserted) < len(plan.run_ids):
            results = self._replayed(cur, plan, inserted, results)
        tasks = plan.tasks_of(inserted)
        if tasks["ids"]:
            transitions.check(TaskState.PENDING, TaskState.READY)  # created READY when free
            counts = cur.execute(q["insert_tasks"], tasks).fetchone()
            upstream, downstream = plan.edges_of(set(tasks["ids"]))
            if upstream:
                cur.execute(q["insert_edges"], {"upstream": upstream, "downstream": downstream})
            if counts and counts["queued"]:
                cur.execute(q["notify_outbox"])
            if counts and counts["waiting"]:
                cur.execute(q["notify_scheduler"])
        return results

    def _replayed(
        self, cur: Cursor, plan: RunPlan, inserted: set[UUID], results: list[TriggerResult]
    ) -> list[TriggerResult]:
        """Resolve runs whose idempotency key already existed: the same request or a conflict."""
        keys = [k for rid, k in zip(plan.run_ids, plan.keys, strict=True) if rid not in inserted]
        existing = {
            r["idempotency_key"]: r
            for r in cur.execute(self._q["find_runs_by_keys"], {"keys": keys})
        }
        for index, (rid, key) in enumerate(zip(plan.run_ids, plan.keys, strict=True)):
            if rid in inserted:
                continue
            found = existing.get(key)
            if found is None or found["request_digest"] != plan.digests[index]:
                raise TriggerConflictError(
                    f"idempotency key {key!r} was used for a different request"
                )
            results[index] = TriggerResult(found["id"], created=False)
        return results

    # ------------------------------------------------------------------ scheduler passes

    def promote_ready(self, limit: int) -> int:
        """PENDING (dependencies met, stream free) and due RETRYING → READY + outbox row."""
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.READY)

        def work(cur: Cursor) -> int:
            row = cur.execute(self._q["promote_ready"], {"limit": limit}).fetchone()
            promoted, queued = (row["promoted"], row["queued"]) if row else (0, 0)
            if queued:
                cur.execute(self._q["notify_outbox"])
            return int(promoted)

        return self._db.run(work)

    def redispatch_lost(self, age_s: float, limit: int) -> int:
        """READY tasks whose confirmed message the broker lost get a new dispatch generation.

        Lost means: published more than ``age_s`` seconds ago and never claimed, while a
        dispatch published after it has been claimed already. Returns how many were re-queued.
        """
        transitions.check(TaskState.READY, TaskState.READY)
        found = self._db.execute(self._q["redispatch_lost"], {"age_s": age_s, "limit": limit})
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

        def facts(row: Mapping[str, Any]) -> FailureFacts:
            return FailureFacts(
                reason=FailureReason(row["failure_reason"] or FailureReason.HANDLER_ERROR),
                attempts_used=row["attempt"] - row["budget_start"],
                crash_streak=row["crash_streak"],
                cancel_requested=row["cancel_requested"],
            )

        return self._apply_policy(
            TaskState.FAILED,
            "lock_failed",
            "apply_routing",
            facts,
            limit,
            crash_loop_threshold,
            observe,
        )

    def reap_expired(
        self,
        limit: int,
        crash_loop_threshold: int = DEFAULT_CRASH_LOOP_THRESHOLD,
        observe: Observer | None = None,
    ) -> int:
        """RUNNING with a lapsed lease → RETRYING / DEAD (crash loop) / CANCELLED, token bumped.

        Returns how many were reaped; ``observe`` is told each one (the scheduler logs them).
        """

        def facts(row: Mapping[str, Any]) -> FailureFacts:
            return FailureFacts(
                reason=FailureReason.LEASE_EXPIRED,
                attempts_used=row["attempt"] - row["budget_start"],
                crash_streak=row["crash_streak"] + 1,
                cancel_requested=row["cancel_requested"],
            )

        return self._apply_policy(
            TaskState.RUNNING,
            "lock_expired_leases",
            "apply_reap",
            facts,
            limit,
            crash_loop_threshold,
            observe,
        )

    def _apply_policy(
        self,
        source: TaskState,
        lock_query: str,
        apply_query: str,
        facts: Callable[[Mapping[str, Any]], FailureFacts],
        limit: int,
        crash_loop_threshold: int,
        observe: Observer | None,
    ) -> int:
        def work(cur: Cursor) -> list[Routed]:
            locked = cur.execute(self._q[lock_query], {"limit": limit}).fetchall()
            if not locked:
                return []
            columns: dict[str, list[Any]] = {
                k: [] for k in ("ids", "tokens", "states", "delays", "reasons")
            }
            for row in locked:
                row_facts = facts(row)
                decision = decide(_policy(row), row_facts, self._rand, crash_loop_threshold)
                state, delay, reason = _decision_columns(decision, row_facts.reason)
                transitions.check(source, state)
                for key, value in zip(
                    columns,
                    (row["id"], row["fencing_token"], str(state), delay, str(reason)),
                    strict=True,
                ):
                    columns[key].append(value)
            changed = cur.execute(self._q[apply_query], columns).fetchall()
            if changed:
                cur.execute(self._q["notify_scheduler"])
            decided = {
                task_id: (delay, reason)
                for task_id, delay, reason in zip(
                    columns["ids"], columns["delays"], columns["reasons"], strict=True
                )
            }
            return [_routed(row, source, *decided[row["id"]]) for row in changed]

        outcomes = self._db.run(work)
        if observe is not None:  # after the commit: a retried transaction counts once
            for routed in outcomes:
                observe(routed)
        return len(outcomes)

    def propagate(self, limit: int) -> int:
        """Apply the consequences of tasks that finished (SUCCEEDED / DEAD / CANCELLED).

        (Success released the dependents already, in the finishing statement.) Death or
        cancellation cancels the dependents that can no longer run (and, for a fail-fast run,
        every task not yet started while running siblings are asked to stop). The runs
        involved have their state derived anew.
        """
        transitions.check(TaskState.PENDING, TaskState.CANCELLED)

        def work(cur: Cursor) -> int:
            q = self._q
            finished = cur.execute(q["lock_unpropagated"], {"limit": limit}).fetchall()
            if not finished:
                return 0
            ended = [r["id"] for r in finished if r["state"] != TaskState.SUCCEEDED]
            fail_fast = sorted(
                {r["run_id"] for r in finished if r["state"] == TaskState.DEAD and r["fail_fast"]}
            )
            if ended:
                cur.execute(q["cancel_dependents"], {"ids": ended})
            if fail_fast:
                self._stop_runs(cur, fail_fast, CancelCause.UPSTREAM)
            cur.execute(q["mark_propagated"], {"ids": [r["id"] for r in finished]})
            # A death or cancellation always changes the run; a success only when it was the
            # last unfinished task (or the run is not RUNNING yet): deriving a big run after
            # every batch of successes would read all its tasks again and again.
            changed = {r["run_id"] for r in finished if r["state"] != TaskState.SUCCEEDED}
            succeeded_only = sorted({r["run_id"] for r in finished} - changed)
            if succeeded_only:
                rows = cur.execute(q["runs_to_derive"], {"ids": succeeded_only}).fetchall()
                changed |= {row["id"] for row in rows}
            self._derive(cur, changed)
            return len(finished)

        return self._db.run(work)

    def purge(self, age_s: float, limit: int, *, key_age_s: float | None = None) -> int:
        """Retention: delete up to ``limit`` each of finished runs and published outbox rows
        older than ``age_s`` and SUCCEEDED idempotency keys unused for ``key_age_s`` (seconds;
        None leaves keys alone); returns the rows deleted. A run with a DEAD (or any
        unsettled) task is never deleted."""

        def work(cur: Cursor) -> int:
            ages = {"purge_runs": age_s, "purge_outbox": age_s, "purge_keys": key_age_s}
            return sum(
                cur.execute(self._q[name], {"age_s": age, "limit": limit}).rowcount
                for name, age in ages.items()
                if age is not None
            )

        return self._db.run(work)

    def _stop_runs(self, cur: Cursor, run_ids: Sequence[UUID], cause: CancelCause) -> None:
        transitions.check(NOT_STARTED_TASK_STATES, TaskState.CANCELLED)
        params = {"run_ids": list(run_ids), "cause": str(cause)}
        cur.execute(self._q["cancel_not_started"], params)
        stopping = cur.execute(self._q["request_stop"], params).fetchall()
        if stopping:  # their workers hear it at the commit; lease renewal stays the fallback
            stopped_runs = sorted({row["run_id"] for row in stopping})
            cur.execute(self._q["notify_cancel"], {"run_ids": stopped_runs})

    def _derive(self, cur: Cursor, run_ids: Iterable[UUID]) -> None:
        """Lock the runs (in id order, after their tasks) and store their derived states."""
        ids = sorted(set(run_ids))
        locked = cur.execute(self._q["lock_runs"], {"ids": ids}).fetchall()
        counts: dict[UUID, dict[TaskState, int]] = {r["id"]: {} for r in locked}
        attempted: dict[UUID, bool] = dict.fromkeys(counts, False)
        for row in cur.execute(self._q["run_facts"], {"ids": ids}).fetchall():
            counts[row["run_id"]][TaskState(row["state"])] = row["n"]
            attempted[row["run_id"]] = attempted[row["run_id"]] or bool(row["attempted"])
        columns: dict[str, list[Any]] = {"ids": [], "states": [], "finished": []}
        for row in locked:
            facts = RunFacts(counts[row["id"]], attempted[row["id"]], row["cancel_requested"])
            columns["ids"].append(row["id"])
            columns["states"].append(str(derive(facts)))
            columns["finished"].append(facts.finished)
        if columns["ids"]:
            cur.execute(self._q["update_run_states"], columns)

    # ------------------------------------------------------------------ worker

    def claim(
        self, task_run_id: UUID, token: int, worker: str, lease_s: float, key_wait_s: float = 1.0
    ) -> ClaimResult:
        """READY → RUNNING for the generation ``token`` names (see :meth:`claim_many`)."""
        return self.claim_many([(task_run_id, token)], worker, lease_s, key_wait_s)[0]

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
        finish, so no message needs to go out.
        """
        transitions.check(TaskState.READY, TaskState.RUNNING)
        if not wanted:
            return []
        # most tasks have no idempotency key: their claims are one statement, one round trip
        found = self._db.execute(self._q["claim"], _claim_params(wanted, worker, lease_s, local))
        # a claim bumps the token: it answers the pair that named the token before the bump
        claimed = {(row["id"], row["fencing_token"] - 1): _claim_from_row(row) for row in found}
        results = []
        for task_run_id, token in wanted:
            claim = claimed.pop((task_run_id, token), None)
            if claim is not None:
                results.append(ClaimResult(ClaimOutcome.EXECUTE, claim))
            else:  # keyed, a duplicate, or not READY with that token any more
                results.append(self._claim_keyed(task_run_id, token, worker, lease_s, key_wait_s))
        return results

    def _claim_keyed(
        self, task_run_id: UUID, token: int, worker: str, lease_s: float, key_wait_s: float
    ) -> ClaimResult:
        params = {
            **_claim_params([(task_run_id, token)], worker, lease_s, local=False),
            "keyless_only": False,
        }
        try:
            return self._db.run(self._claim_with_key, params)
        except _KeyBusyError:
            transitions.check(TaskState.READY, TaskState.RETRYING)
            deferred = self._db.run(
                lambda cur: cur.execute(
                    self._q["defer"], {"id": task_run_id, "token": token, "delay_s": key_wait_s}
                ).fetchone()
            )
            return ClaimResult(ClaimOutcome.DEFERRED if deferred else ClaimOutcome.LOST)

    def _claim_with_key(self, cur: Cursor, params: dict[str, Any]) -> ClaimResult:
        row = cur.execute(self._q["claim"], params).fetchone()
        if row is None:
            return ClaimResult(ClaimOutcome.LOST)
        claim = _claim_from_row(row)
        if claim.idempotency_key is None:
            return ClaimResult(ClaimOutcome.EXECUTE, claim)
        key_params = {
            "key": claim.idempotency_key,
            "id": claim.task_run_id,
            "token": claim.fencing_token,
            "lease_s": params["lease_s"],
        }
        if cur.execute(self._q["acquire_key"], key_params).fetchone():
            return ClaimResult(ClaimOutcome.EXECUTE, claim)
        held = cur.execute(self._q["read_key"], key_params).fetchone()
        if held is None or held["state"] != TaskState.SUCCEEDED:
            raise _KeyBusyError
        reused = Finish(TaskState.SUCCEEDED, result=held["result"])
        columns = _finish_columns([(claim.task_run_id, claim.fencing_token, reused)], "reused")
        cur.execute(self._q["finish"], {**columns, "offer": 0})
        return ClaimResult(ClaimOutcome.REUSED, claim)

    def release_claims(self, claims: Sequence[tuple[UUID, int]]) -> int:
        """Hand back claims whose handler never started; returns how many.

        The attempt is un-counted. RUNNING → READY with a new outbox row, so the task is
        dispatched again (to any worker); RUNNING → CANCELLED instead when its run asked it to
        stop meanwhile. A pair whose token is no longer current is left alone.
        """
        transitions.check(TaskState.RUNNING, TaskState.READY)
        transitions.check(TaskState.RUNNING, TaskState.CANCELLED)
        if not claims:
            return 0
        params = {"ids": [c[0] for c in claims], "tokens": [c[1] for c in claims]}
        return len(self._db.execute(self._q["release_claims"], params))

    def renew_lease(self, task_run_id: UUID, token: int, lease_s: float) -> Renewal:
        """Extend a held lease by ``lease_s`` from the database's now; report cancellation."""
        held = self.renew_leases([(task_run_id, token)], lease_s)
        return Renewal(held=task_run_id in held, cancel_requested=held.get(task_run_id, False))

    def renew_leases(self, claims: Sequence[tuple[UUID, int]], lease_s: float) -> dict[UUID, bool]:
        """Extend every lease still held among ``claims`` by ``lease_s`` (database clock).

        Returns ``{task run id: cancel requested}`` for the leases still held; a pair missing
        from it lost its lease (reaped, or finished elsewhere).
        """
        if not claims:
            return {}
        params = {
            "ids": [c[0] for c in claims],
            "tokens": [c[1] for c in claims],
            "lease_s": lease_s,
        }
        rows_ = self._db.execute(self._q["renew_leases"], params)
        return {row["id"]: bool(row["cancel_requested"]) for row in rows_}

    def finish(
        self,
        task_run_id: UUID,
        token: int,
        state: TaskState,
        *,
        result: Any = None,
        reason: FailureReason | None = None,
        error: str | None = None,
        traceback: str | None = None,
    ) -> bool:
        """RUNNING → ``state`` (SUCCEEDED, FAILED or CANCELLED) if ``token`` is current.

        Returns False for a stale token (the task was reaped or finished by someone else).
        """
        outcome = Finish(state, result, reason, error, traceback)
        return bool(self.finish_many([(task_run_id, token, outcome)]).committed)

    def finish_many(
        self,
        outcomes: Sequence[tuple[UUID, int, Finish]],
        offer: int | None = None,
        then: Continuation | None = None,
    ) -> Finished:
        """Finish each (task run, token, outcome) whose token is current, in one statement.

        Reports the ids that committed (the others were stale: reaped, or finished elsewhere,
        and are counted as stale completions) and up to ``offer`` (None: all) of the
        dependents the successes made READY. With ``then``, the same transaction also claims
        the first ``then.limit`` of those (keyless ones; see :meth:`claim_many` with
        ``local``): their outbox rows are stamped before any publisher can see them, so the
        next step of a chain cannot be published and claimed by another worker first.
        """
        if not outcomes:
            return Finished(frozenset(), ())
        transitions.check(TaskState.PENDING, TaskState.READY)  # dependents released
        params = {**_finish_columns(outcomes), "offer": offer}
        if then is None or then.limit <= 0:
            return _finished(self._db.execute(self._q["finish"], params))
        transitions.check(TaskState.READY, TaskState.RUNNING)
        return self._db.run(self._finish_then_claim, params, then)

    def _finish_then_claim(
        self, cur: Cursor, params: dict[str, Any], then: Continuation
    ) -> Finished:
        finished = _finished(cur.execute(self._q["finish"], params).fetchall())
        wanted = finished.ready[: then.limit]
        if not wanted:
            return finished
        params = _claim_params(wanted, then.worker, then.lease_s, local=True)
        found = cur.execute(self._q["claim"], params).fetchall()
        return replace(finished, claimed=tuple(_claim_from_row(row) for row in found))

    # ------------------------------------------------------------------ publisher

    def publish_outbox(
        self, limit: int, send: Callable[[Sequence[Dispatch]], Collection[int]]
    ) -> tuple[int, int]:
        """Lock up to ``limit`` pending outbox rows and hand them to ``send``.

        ``send`` publishes them and returns the outbox ids the broker *confirmed*; only those
        are stamped, in the same transaction. If ``send`` raises, nothing is stamped and every
        row stays pending. Returns (rows handed over, rows stamped).
        """

        def work(cur: Cursor) -> tuple[int, int]:
            locked = cur.execute(self._q["lock_outbox"], {"limit": limit}).fetchall()
            if not locked:
                return 0, 0
            batch = [Dispatch(r["id"], r["task_run_id"], r["fencing_token"]) for r in locked]
            confirmed = sorted(set(send(batch)) & {d.outbox_id for d in batch})
            if confirmed:
                cur.execute(self._q["stamp_outbox"], {"ids": confirmed})
            return len(batch), len(confirmed)

        return self._db.run(work)

    # ------------------------------------------------------------------ process registry

    def register_process(self, process_id: UUID, host: str, pid: int, role: str) -> None:
        params = {"id": process_id, "host": host, "pid": pid, "role": role}
        self._db.run(lambda cur: cur.execute(self._q["register_process"], params))

    def deregister_process(self, process_id: UUID) -> None:
        self._db.run(lambda cur: cur.execute(self._q["deregister_process"], {"id": process_id}))

    def forget_silent_processes(self, age_s: float) -> int:
        def work(cur: Cursor) -> int:
            return cur.execute(self._q["forget_silent_processes"], {"age_s": age_s}).rowcount

        return self._db.run(work)

    def list_processes(self) -> list[ProcessInfo]:
        with self._db.transaction() as cur:
            found = cur.execute(self._q["list_processes"]).fetchall()
        return [ProcessInfo(**{**r, "silent_s": float(r["silent_s"])}) for r in found]

    def counters(self) -> dict[str, int]:
        """Global event counters (e.g. ``stale_completions``)."""
        with self._db.transaction() as cur:
            return {r["name"]: r["value"] for r in cur.execute(self._q["read_counters"]).fetchall()}

    # ------------------------------------------------------------------ operations

    def ping(self) -> None:
        """Raise :class:`DatabaseUnavailableError` unless PostgreSQL answers."""
        with self._db.transaction() as cur:
            cur.execute(self._q["ping"])

    def task_state_counts(self) -> dict[str, int]:
        with self._db.transaction() as cur:
            found = cur.execute(self._q["task_state_counts"]).fetchall()
        return {r["state"]: r["n"] for r in found}

    def outbox_backlog(self) -> tuple[int, float]:
        """(pending outbox rows, age in seconds of the oldest one; 0 when none)."""
        with self._db.transaction() as cur:
            row = cur.execute(self._q["outbox_backlog"]).fetchone()
        return (row["pending"], row["oldest_s"]) if row else (0, 0.0)

    def live_process_counts(self, fresh_s: float) -> dict[str, int]:
        """Registered processes seen within ``fresh_s`` seconds, by role."""
        with self._db.transaction() as cur:
            found = cur.execute(self._q["live_process_counts"], {"fresh_s": fresh_s}).fetchall()
        return {r["role"]: r["n"] for r in found}

    def stats(self, poison_threshold: int, limit: int = 20) -> dict[str, Any]:
        """Retry distribution, failure reasons, retry backlog, poison candidates, dead tasks."""
        q = self._q
        with self._db.transaction() as cur:
            attempts = cur.execute(q["stats_attempts"]).fetchall()
            reasons = cur.execute(q["stats_failure_reasons"]).fetchall()
            retries = self._retry_backlog_and_poison(cur, poison_threshold, limit)
            dead = cur.execute(q["stats_dead_by_workflow"]).fetchall()
        return {
            "attempts": {r["attempt"]: r["n"] for r in attempts},
            "failure_reasons": {r["reason"]: r["n"] for r in reasons},
            **retries,
            "dead": [dict(r) for r in dead],
        }

    def _retry_backlog_and_poison(
        self, cur: Cursor, poison_threshold: int, limit: int
    ) -> dict[str, Any]:
        """``retry_backlog`` (n, next_at, latest_at) and ``poison_candidates`` (at most
        ``limit`` unfinished tasks with ``poison_threshold`` attempts or more), for
        :meth:`stats` and :meth:`overview`."""
        backlog = cur.execute(self._q["stats_retry_backlog"]).fetchone()
        poison = cur.execute(
            self._q["stats_poison_candidates"], {"threshold": poison_threshold, "limit": limit}
        ).fetchall()
        return {
            "retry_backlog": dict(backlog or {"n": 0, "next_at": None, "latest_at": None}),
            "poison_candidates": [dict(r) for r in poison],
        }

    # ------------------------------------------------------------------ operator actions

    def cancel_run(self, run_id: UUID | str) -> Run:
        """Cancel what has not started, ask running tasks to stop; return the run after."""
        rid = parse_id(run_id, "run id")

        def work(cur: Cursor) -> None:
            self._stop_runs(cur, [rid], CancelCause.OPERATOR)
            if cur.execute(self._q["mark_run_cancel_requested"], {"id": rid}).fetchone() is None:
                raise NotFoundError(f"no run with id {rid}")
            self._derive(cur, [rid])
            cur.execute(self._q["notify_scheduler"])

        self._db.run(work)
        return self.get_run(rid)

    def requeue_dead(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> TaskRun:
        """DEAD → PENDING with a fresh retry budget, recorded in the audit table.

        Tasks of the same run that were cancelled only because this one died come back too.
        """
        tid = parse_id(task_run_id, "task run id")
        _check_requeue_text(requested_by, reason)
        self._requeue(tid, requested_by, reason)
        return self.get_task(tid)

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
        _check_requeue_text(requested_by, reason)
        params = _dead_params(match)
        with self._db.transaction() as cur:
            row = cur.execute(self._q["count_dead"], params, prepare=False).fetchone()
            matched = int(row["n"]) if row else 0
            ids: list[UUID] = []
            if not dry_run and matched:
                found = cur.execute(
                    self._q["dead_ids_matching"], {**params, "limit": limit}, prepare=False
                ).fetchall()
                ids = [r["id"] for r in found]
        if dry_run:
            return BulkRequeue(matched, limit, dry_run=True)
        requeued: list[UUID] = []
        skipped: list[UUID] = []
        for tid in ids:
            try:
                self._requeue(tid, requested_by, reason)
            except (NotDeadError, NotFoundError):
                skipped.append(tid)  # requeued or purged by someone else meanwhile
            else:
                requeued.append(tid)
        logger.info(
            "bulk requeue: %d of %d matching dead task(s) requeued, %d skipped",
            len(requeued),
            matched,
            len(skipped),
            extra={"action": "tasks_requeued"},
        )
        return BulkRequeue(matched, limit, False, tuple(requeued), tuple(skipped))

    def _requeue(self, tid: UUID, requested_by: str, reason: str | None) -> None:
        """One dead task → PENDING with its audit row, in one transaction."""
        transitions.check(TaskState.DEAD, TaskState.PENDING)
        transitions.check(TaskState.CANCELLED, TaskState.PENDING)

        def work(cur: Cursor) -> None:
            q = self._q
            current = cur.execute(q["task_state"], {"id": tid}).fetchone()
            if current is None:
                raise NotFoundError(f"no task run with id {tid}")
            if current["state"] != TaskState.DEAD:
                raise NotDeadError(
                    f"task run {tid} is {current['state']}, not DEAD: nothing to requeue"
                )
            row = cur.execute(q["requeue_dead"], {"id": tid}).fetchone()
            if row is None:  # it changed since we looked: report it like any other non-dead task
                raise NotDeadError(f"task run {tid} is no longer DEAD: nothing to requeue")
            cur.execute(q["revive_cancelled"], {"run_id": row["run_id"], "id": tid})
            cur.execute(
                q["insert_audit"],
                {
                    "id": tid,
                    "by": requested_by,
                    "reason": reason,
                    "previous_reason": current["failure_reason"],
                    "attempt": current["attempt"],
                },
            )
            self._derive(cur, [row["run_id"]])
            cur.execute(q["notify_scheduler"])

        self._db.run(work)
        logger.info("requeued dead task run %s", tid, extra={"action": "task_requeued"})

    # ------------------------------------------------------------------ reads

    def get_run(self, run_id: UUID | str) -> Run:
        """The run with its tasks; :class:`NotFoundError` if there is none."""
        rid = parse_id(run_id, "run id")
        with self._db.transaction() as cur:
            row = cur.execute(self._q["get_run"], {"id": rid}).fetchone()
            if row is None:
                raise NotFoundError(f"no run with id {rid}")
            tasks = cur.execute(self._q["get_run_tasks"], {"id": rid}).fetchall()
        return rows.run(row, tuple(rows.task_run(t) for t in tasks))

    def get_task(self, task_run_id: UUID | str) -> TaskRun:
        tid = parse_id(task_run_id, "task run id")
        with self._db.transaction() as cur:
            row = cur.execute(self._q["get_task"], {"id": tid}).fetchone()
        if row is None:
            raise NotFoundError(f"no task run with id {tid}")
        return rows.task_run(row)

    def attempts(self, task_run_id: UUID | str) -> list[Attempt]:
        tid = parse_id(task_run_id, "task run id")
        with self._db.transaction() as cur:
            return [
                rows.attempt(r)
                for r in cur.execute(self._q["get_attempts"], {"id": tid}).fetchall()
            ]

    def list_runs(
        self,
        *,
        state: str | None = None,
        workflow: str | None = None,
        limit: int = 50,
        before: tuple[datetime, UUID] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[Run]:
        """Runs newest first (without their tasks), keyset-paginated by ``before``.

        ``since`` / ``until`` bound ``created_at`` to [since, until).
        """
        params = {
            "state": state,
            "workflow": _filter(workflow, "workflow"),
            "since": since,
            "until": until,
            "limit": limit,
            "before_created": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        with self._db.transaction() as cur:
            # never prepared: a generic plan could not use the index of each filter combination
            found = cur.execute(self._q["list_runs"], params, prepare=False).fetchall()
        return [rows.run(r) for r in found]

    def list_dead(
        self,
        limit: int = 100,
        *,
        match: DeadFilter | None = None,
        before: tuple[datetime, UUID] | None = None,
    ) -> list[DeadTask]:
        """Dead tasks newest first (by finished_at, id), filtered by ``match``, keyset-paginated
        by ``before`` (the (finished_at, id) of the last task of the previous page)."""
        params = {
            **_dead_params(match or DeadFilter()),
            "limit": limit,
            "before_finished": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        with self._db.transaction() as cur:
            found = cur.execute(self._q["list_dead"], params, prepare=False).fetchall()
        return [rows.dead_task(r) for r in found]

    def task_detail(self, task_run_id: UUID | str) -> TaskDetail:
        """A task run with its attempts, its run's input, its upstream results and its requeue
        history, read in one transaction; :class:`NotFoundError` if there is none."""
        tid = parse_id(task_run_id, "task run id")
        q = self._q
        with self._db.transaction() as cur:
            row = cur.execute(q["get_task"], {"id": tid}).fetchone()
            context = cur.execute(q["task_context"], {"id": tid}).fetchone()
            if row is None or context is None:
                raise NotFoundError(f"no task run with id {tid}")
            attempts = cur.execute(q["get_attempts"], {"id": tid}).fetchall()
            audit = cur.execute(q["get_audit"], {"id": tid}).fetchall()
        return TaskDetail(
            task=rows.task_run(row),
            workflow=context["workflow"],
            run_state=RunState(context["run_state"]),
            input=context["input"],
            upstream=context["upstream"],
            attempts=tuple(rows.attempt(a) for a in attempts),
            audit=tuple(rows.audit_entry(a) for a in audit),
        )

    def overview(self, poison_threshold: int, fresh_s: float, limit: int = 20) -> dict[str, Any]:
        """The dashboard's overview, read in one transaction.

        Keys: ``runs`` and ``tasks`` (count by state, every state present), ``finished_per_minute``
        (60 rows, oldest first: ``minute``, ``succeeded``, ``dead``, ``cancelled``),
        ``retry_backlog`` (``n``, ``next_at``, ``latest_at``), ``poison_candidates`` (at most
        ``limit`` unfinished tasks with ``poison_threshold`` attempts or more),
        ``dead_by_reason`` ({reason: n}), ``outbox`` (``pending``, ``oldest_s``) and
        ``processes`` (``host``, ``role``, ``n`` of processes seen within ``fresh_s``).
        """
        q = self._q
        with self._db.transaction() as cur:
            runs = cur.execute(q["run_state_counts"]).fetchall()
            tasks = cur.execute(q["task_state_counts"]).fetchall()
            minutes = cur.execute(q["finished_per_minute"]).fetchall()
            retries = self._retry_backlog_and_poison(cur, poison_threshold, limit)
            dead = cur.execute(q["dead_by_reason"]).fetchall()
            outbox = cur.execute(q["outbox_backlog"]).fetchone()
            processes = cur.execute(q["live_processes_by_host"], {"fresh_s": fresh_s}).fetchall()
        return {
            "runs": {**{str(s): 0 for s in RunState}, **{r["state"]: r["n"] for r in runs}},
            "tasks": {**{str(s): 0 for s in TaskState}, **{r["state"]: r["n"] for r in tasks}},
            "finished_per_minute": [dict(r) for r in minutes],
            **retries,
            "dead_by_reason": {r["reason"]: r["n"] for r in dead},
            "outbox": dict(outbox or {"pending": 0, "oldest_s": 0.0}),
            "processes": [dict(r) for r in processes],
        }

    # ------------------------------------------------------------------ operator purge

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
        _filter(workflow, "workflow")
        select = {"age_s": age_s, "workflow": workflow}

        def work(cur: Cursor) -> DeadPurge:
            q = self._q
            ids: list[UUID] = []
            while not ids:
                ids = self._purgeable(cur, {**select, "only": None, "limit": limit})
                if not ids:
                    return DeadPurge()
                cur.execute(q["lock_run_tasks"], {"ids": ids})
                # a requeue may have committed while we waited: look again, under the locks
                # (a run that no longer qualifies cannot qualify again in this transaction:
                # its cutoff is fixed at the transaction's now())
                ids = self._purgeable(cur, {**select, "only": ids, "limit": None})
            preview = self._dead_purge_preview(cur, ids, show=0)
            cur.execute(
                q["delete_purged_runs"],
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

        purged = self._db.run(work)
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
        _filter(workflow, "workflow")
        params = {"age_s": age_s, "workflow": workflow, "only": None, "limit": None}

        def work(cur: Cursor) -> DeadPurge:
            return self._dead_purge_preview(cur, self._purgeable(cur, params), show)

        return self._db.run(work)

    def count_old_dead(self, age_s: float, workflow: str | None = None) -> int:
        """DEAD tasks that died over ``age_s`` seconds ago (of ``workflow`` or of all)."""
        _filter(workflow, "workflow")
        rows = self._db.execute(self._q["count_old_dead"], {"age_s": age_s, "workflow": workflow})
        return int(rows[0]["n"])

    def _purgeable(self, cur: Cursor, params: Mapping[str, Any]) -> list[UUID]:
        return [r["id"] for r in cur.execute(self._q["purgeable_dead_runs"], params)]

    def _dead_purge_preview(self, cur: Cursor, ids: Sequence[UUID], show: int) -> DeadPurge:
        row = cur.execute(
            self._q["dead_purge_preview"], {"ids": list(ids), "show": show}
        ).fetchone()
        assert row is not None  # an aggregate always answers one row
        return DeadPurge(
            runs=int(row["runs"]),
            tasks=int(row["tasks"]),
            dead_task_ids=tuple(row["dead_task_ids"]),
            released_streams=tuple(row["released_streams"]),
            shown=tuple(row["shown"]),
        )


def _dead_params(match: DeadFilter) -> dict[str, Any]:
    """The filter parameters shared by ``list_dead``, ``count_dead`` and ``dead_ids_matching``."""
    return {
        "reason": str(match.reason) if match.reason else None,
        "workflow": _filter(match.workflow, "workflow"),
        "handler": _filter(match.handler, "handler"),
    }


def _filter(value: str | None, name: str) -> str | None:
    """A text filter PostgreSQL can take as a parameter, or the caller's mistake."""
    return None if value is None else check_text(value, f"the {name} filter")


def _check_requeue_text(requested_by: str, reason: str | None) -> None:
    """What the operator wrote for the audit, refused (never altered) before any change if
    PostgreSQL text could not hold it: NUL, a lone surrogate, over MAX_NOTE_BYTES."""
    check_text(requested_by, "requested_by", MAX_NOTE_BYTES)
    if reason is not None:
        check_text(reason, "the requeue reason", MAX_NOTE_BYTES)


def _jsonb(text: JsonText) -> Jsonb:
    """Text :func:`to_json` made, sent as ``jsonb`` without encoding it a second time."""
    return Jsonb(text, dumps=str)


def _stored_result(result: Any) -> Jsonb | None:
    """A finish's result as a parameter: checked here unless the worker has (a JsonText)."""
    if result is None:
        return None
    return _jsonb(result if isinstance(result, JsonText) else to_json(result, "the result"))


def _policy(row: Mapping[str, Any]) -> RetryPolicy:
    return RetryPolicy(
        row["max_attempts"], row["base_delay_s"], row["max_delay_s"], Jitter(row["jitter"])
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


def _routed(row: Mapping[str, Any], source: TaskState, delay_s: float, reason: str) -> Routed:
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


def _claim_params(
    wanted: Sequence[tuple[UUID, int]], worker: str, lease_s: float, local: bool
) -> dict[str, Any]:
    """The ``claim`` query's parameters for the keyless tasks among (task run, token) pairs."""
    return {
        "ids": [task_run_id for task_run_id, _ in wanted],
        "tokens": [token for _, token in wanted],
        "worker": worker,
        "lease_s": lease_s,
        "local": local,
        "keyless_only": True,
    }


def _finished(found: Sequence[Mapping[str, Any]]) -> Finished:
    """The ``finish`` query's rows: finished ids (no ready token), then released dependents."""
    return Finished(
        committed=frozenset(row["id"] for row in found if row["ready_token"] is None),
        ready=tuple(
            (row["id"], row["ready_token"]) for row in found if row["ready_token"] is not None
        ),
    )


def _claim_from_row(row: Mapping[str, Any]) -> Claim:
    return Claim(
        task_run_id=row["id"],
        run_id=row["run_id"],
        name=row["name"],
        handler=row["handler"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        input=row["input"],
        upstream=row["upstream"],
        timeout_s=row["timeout_s"],
        idempotency_key=row["idempotency_key"],
        dispatch_lag_s=row["dispatch_lag_s"] or 0.0,
        workflow=row["workflow"],
    )


def _finish_columns(
    outcomes: Sequence[tuple[UUID, int, Finish]], label: str | None = None
) -> dict[str, list[Any]]:
    """The ``finish`` query's parameter arrays; each transition is checked first.

    ``label`` overrides the attempt outcome written (``reused`` for a stored result).
    """
    columns: dict[str, list[Any]] = {
        k: []
        for k in (
            "ids",
            "tokens",
            "states",
            "results",
            "reasons",
            "errors",
            "tracebacks",
            "outcomes",
        )
    }
    for task_run_id, token, finish in outcomes:
        transitions.check(TaskState.RUNNING, finish.state)
        if finish.state not in _OUTCOMES:
            raise IllegalTransitionError(
                f"finish writes SUCCEEDED, FAILED or CANCELLED, not {finish.state} (the reaper's)"
            )
        if finish.state is TaskState.FAILED and finish.reason is None:
            raise ValueError("a failure needs a reason")
        reason = FailureReason.CANCELLED if finish.state is TaskState.CANCELLED else finish.reason
        columns["ids"].append(task_run_id)
        columns["tokens"].append(token)
        columns["states"].append(str(finish.state))
        columns["results"].append(_stored_result(finish.result))
        columns["reasons"].append(None if reason is None else str(reason))
        # free text from handlers: cleaned (NUL, lone surrogates → U+FFFD) and cut, never refused
        error, tb = finish.error, finish.traceback
        columns["errors"].append(None if error is None else clean_text(error, MAX_ERROR_CHARS))
        columns["tracebacks"].append(
            None if tb is None else clean_text(tb, MAX_TRACEBACK_CHARS, keep_end=True)
        )
        columns["outcomes"].append(label or _OUTCOMES[finish.state])
    return columns
