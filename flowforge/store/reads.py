"""Read models: runs, tasks, dead tasks, the dashboard's overview, stats, health and metrics.

Nothing here changes state. A read made of several statements runs them in one transaction;
a single statement runs on its own (one round trip).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from flowforge.domain.model import (
    Attempt,
    DeadFilter,
    DeadTask,
    OutboxBacklog,
    Overview,
    QueueLoad,
    RerunEntry,
    Run,
    Stats,
    TaskDetail,
    TaskRun,
    parse_id,
)
from flowforge.domain.output import AttemptLog, parse_attempt
from flowforge.domain.states import RunState
from flowforge.domain.values import check_text
from flowforge.errors import NotFoundError
from flowforge.store import rows
from flowforge.store.db import Row
from flowforge.store.part import Part, Tx

#: A registered process seen within this many seconds counts as alive (the api's probes and
#: gauges use the same).
LIVE_S = 15.0
#: Above this many rows a count of runs or tasks by state, of READY tasks per queue or of
#: attempts is PostgreSQL's estimate, and says so (migration 0024): every read of the overview,
#: /metrics, /health/ready and `stats` stays cheap with millions of rows stored.
COUNT_CAP = 100_000
#: `stats` groups at most this many dead task runs, the newest, by workflow, handler and
#: reason (``Stats.dead_newest_only`` says when there are more): each needs its run's workflow,
#: a lookup by key, so the read grows with the dead tasks counted, not with the store.
DEAD_GROUPS_CAP = 10_000


class Reads(Part):
    """What the API, the CLI, the client and the health checks read."""

    def get_run(self, run_id: UUID | str) -> Run:
        """The run with its tasks; :class:`NotFoundError` if there is none. One round trip
        (its three statements pipelined, one implicit transaction)."""
        return self._pipelined_read(run_with_tasks, parse_id(run_id, "run id"))

    def rerun_history(self, run_id: UUID | str) -> tuple[RerunEntry, ...]:
        """Every rerun of the run (who, when, why, from which task, which task runs), oldest
        first; empty for a run never rerun or unknown."""
        found = self._query("get_rerun_audit", {"id": parse_id(run_id, "run id")})
        return tuple(rows.rerun_entry(r) for r in found)

    def get_task(self, task_run_id: UUID | str) -> TaskRun:
        """A task run; :class:`NotFoundError` if there is none."""
        tid = parse_id(task_run_id, "task run id")
        found = self._query("get_task", {"id": tid})
        if not found:
            raise NotFoundError(f"no task run with id {tid}")
        return rows.task_run(found[0])

    def attempt_log(self, task_run_id: UUID | str, attempt: int | None = None) -> AttemptLog:
        """What ``attempt`` (None: the latest) of a task run captured, as stored so far;
        :class:`NotFoundError` if there is no such task run or attempt, :class:`InputError`
        for an attempt number that is not an integer from 1 to 2**31 - 1. A task run without
        any attempt yet has ``attempt`` None and an empty output."""
        tid = parse_id(task_run_id, "task run id")
        attempt = parse_attempt(attempt)
        found = self._query("get_attempt_output", {"id": tid, "attempt": attempt})
        if not found:
            raise NotFoundError(f"no task run with id {tid}")
        if attempt is not None and found[0]["attempt"] is None:
            raise NotFoundError(f"task run {tid} has no attempt {attempt}")
        return rows.attempt_log(found[0], tid)

    def attempts(self, task_run_id: UUID | str) -> list[Attempt]:
        """A task run's attempts, first first."""
        tid = parse_id(task_run_id, "task run id")
        return [rows.attempt(r) for r in self._query("get_attempts", {"id": tid})]

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
            "workflow": text_filter(workflow, "workflow"),
            "since": since,
            "until": until,
            "limit": limit,
            "before_created": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        # never prepared (no statement is: store/db.py), so each filter combination's plan
        # can use its index
        return [rows.run(r) for r in self._query("list_runs", params)]

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
            **dead_params(match or DeadFilter()),
            "limit": limit,
            "before_finished": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        return [rows.dead_task(r) for r in self._query("list_dead", params)]

    def task_detail(self, task_run_id: UUID | str) -> TaskDetail:
        """A task run with its attempts, its run's input, its upstream results and its requeue
        history, read in one transaction; :class:`NotFoundError` if there is none."""
        return self._transaction(_task_detail, parse_id(task_run_id, "task run id"))

    def overview(
        self, poison_threshold: int, fresh_s: float, limit: int = 20, cap: int = COUNT_CAP
    ) -> Overview:
        """The dashboard's overview, read in one transaction: counts of runs and tasks by
        state, the last hour's finishes per minute, the retry backlog, at most ``limit``
        poison candidates (unfinished tasks with ``poison_threshold`` attempts or more), dead
        tasks by reason, the outbox backlog and the processes seen within ``fresh_s`` seconds.
        A count above ``cap`` is an estimate (``estimated_runs``, ``estimated_tasks``).
        """
        return self._transaction(_overview, poison_threshold, fresh_s, limit, cap)

    def stats(
        self,
        poison_threshold: int,
        limit: int = 20,
        fresh_s: float = LIVE_S,
        cap: int = COUNT_CAP,
        dead_cap: int = DEAD_GROUPS_CAP,
    ) -> Stats:
        """Retry distribution, failure reasons, retry backlog, poison candidates (as in
        :meth:`overview`), dead tasks by workflow, handler and reason (the newest ``dead_cap``
        of them: ``dead_newest_only``), and READY tasks and live consumers (seen within
        ``fresh_s`` seconds) per queue, in one transaction. Above ``cap`` task runs the retry
        distribution is an estimate (``attempts_estimated``), and so is a queue's READY count
        above ``cap``."""
        return self._transaction(_stats, poison_threshold, limit, fresh_s, cap, dead_cap)

    def queue_loads(self, fresh_s: float = LIVE_S, cap: int = COUNT_CAP) -> tuple[QueueLoad, ...]:
        """READY task runs (up to ``cap``, else ``cap`` + 1 and ``estimated``) and live
        consumers (seen within ``fresh_s`` seconds) per queue."""
        return rows.queue_loads(self._query("queue_load", {"fresh_s": fresh_s, "cap": cap}))

    def ping(self) -> None:
        """Raise :class:`DatabaseUnavailableError` unless PostgreSQL answers."""
        self._query("ping")

    def task_state_counts(self, cap: int = COUNT_CAP) -> dict[str, int]:
        """Task runs by state (states with none are absent); a count above ``cap`` is
        PostgreSQL's estimate."""
        return rows.tally(self._query("task_state_counts", {"cap": cap}), "state")

    def outbox_backlog(self) -> OutboxBacklog:
        """Pending outbox rows and the age in seconds of the oldest one (0 when none)."""
        return rows.outbox_backlog(_first(self._query("outbox_backlog")))

    def live_process_counts(self, fresh_s: float) -> dict[str, int]:
        """Registered processes seen within ``fresh_s`` seconds, by role."""
        return rows.tally(self._query("live_process_counts", {"fresh_s": fresh_s}), "role")


def dead_params(match: DeadFilter) -> dict[str, Any]:
    """The filter parameters shared by ``list_dead``, ``count_dead`` and ``dead_ids_matching``."""
    return {
        "reason": str(match.reason) if match.reason else None,
        "workflow": text_filter(match.workflow, "workflow"),
        "handler": text_filter(match.handler, "handler"),
    }


def text_filter(value: str | None, name: str) -> str | None:
    """A text filter PostgreSQL can take as a parameter, or the caller's mistake."""
    return None if value is None else check_text(value, f"the {name} filter")


def run_with_tasks(tx: Tx, rid: UUID) -> Run:
    """The run with its tasks, in the caller's transaction (an action answers with it); its
    three statements go together (:meth:`Tx.later`)."""
    run = tx.later("get_run", {"id": rid})
    tasks = tx.later("get_run_tasks", {"id": rid})
    children = tx.later("run_children", {"id": rid})
    tx.sync()
    row = run.fetchone()
    if row is None:
        raise NotFoundError(f"no run with id {rid}")
    return rows.run(
        row,
        tuple(rows.task_run(t) for t in tasks.fetchall()),
        tuple(rows.child_run(c) for c in children.fetchall()),
    )


def task_by_id(tx: Tx, tid: UUID) -> TaskRun:
    """A task run, in the caller's transaction (an action answers with it)."""
    row = tx.one("get_task", {"id": tid})
    if row is None:
        raise NotFoundError(f"no task run with id {tid}")
    return rows.task_run(row)


def _task_detail(tx: Tx, tid: UUID) -> TaskDetail:
    row = tx.one("get_task", {"id": tid})
    context = tx.one("task_context", {"id": tid})
    if row is None or context is None:
        raise NotFoundError(f"no task run with id {tid}")
    attempts = tx.all("get_attempts", {"id": tid})
    audit = tx.all("get_audit", {"id": tid})
    return TaskDetail(
        task=rows.task_run(row),
        workflow=context["workflow"],
        run_state=RunState(context["run_state"]),
        input=context["input"],
        upstream=context["upstream"],
        attempts=tuple(rows.attempt(a) for a in attempts),
        audit=tuple(rows.audit_entry(a) for a in audit),
    )


def _overview(tx: Tx, poison_threshold: int, fresh_s: float, limit: int, cap: int) -> Overview:
    return rows.overview(
        runs=tx.all("run_state_counts", {"cap": cap}),
        tasks=tx.all("task_state_counts", {"cap": cap}),
        minutes=tx.all("finished_per_minute"),
        backlog=tx.one("stats_retry_backlog"),
        poison=tx.all("stats_poison_candidates", {"threshold": poison_threshold, "limit": limit}),
        dead=tx.all("dead_by_reason"),
        outbox=tx.one("outbox_backlog"),
        processes=tx.all("live_processes_by_host", {"fresh_s": fresh_s}),
        queues=tx.all("queue_load", {"fresh_s": fresh_s, "cap": cap}),
    )


def _stats(
    tx: Tx, poison_threshold: int, limit: int, fresh_s: float, cap: int, dead_cap: int
) -> Stats:
    return rows.stats(
        attempts=tx.all("stats_attempts", {"cap": cap}),
        reasons=tx.all("stats_failure_reasons"),
        backlog=tx.one("stats_retry_backlog"),
        poison=tx.all("stats_poison_candidates", {"threshold": poison_threshold, "limit": limit}),
        dead=tx.all("stats_dead_by_workflow", {"cap": dead_cap}),
        queues=tx.all("queue_load", {"fresh_s": fresh_s, "cap": cap}),
    )


def _first(found: list[Row]) -> Row | None:
    return found[0] if found else None
