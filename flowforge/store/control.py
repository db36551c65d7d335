"""An operator's control of one task: cancel, retry now, bury (SPEC 7.4), and what holds a key.

Each action is one transaction: read the task's facts, let :func:`~flowforge.domain.control.plan`
decide (or refuse, naming the state), apply it with a statement conditional on the state and
fencing token read — a scheduler or worker that moved the task meanwhile wins, and the action
is refused with nothing changed — and write its ``task_audit`` row (who, when, why, from which
state to which). Refusals change and audit nothing.
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from flowforge.domain import transitions
from flowforge.domain.control import (
    TARGET,
    Action,
    Controlled,
    Effect,
    HoldKind,
    KeyHold,
    TaskFacts,
    plan,
    why_holds,
    why_holds_rate,
    why_holds_slot,
    why_waits,
    why_waits_rate,
    why_waits_slot,
)
from flowforge.domain.model import parse_id
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import NOT_STARTED_TASK_STATES, TaskState
from flowforge.domain.values import MAX_KEY_BYTES, check_note, check_text
from flowforge.errors import NotFoundError, WrongStateError
from flowforge.store import rows
from flowforge.store.db import Row
from flowforge.store.part import Tx
from flowforge.store.reads import Reads, task_by_id
from flowforge.store.runs import cancel_child_runs, derive_states

logger = logging.getLogger(__name__)

#: ``flowforge keys show`` lists at most this many of the tasks waiting behind a holder.
KEY_NEXT_SHOWN = 20
#: Most holders of a concurrency key listed (its limit may be larger; the count is exact).
KEY_SLOTS_SHOWN = 100


class Control(Reads):
    """What an operator does to one task (CLI ``flowforge task``, API, client, dashboard)."""

    def cancel_task(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """Cancel one task: not started (or a sleeping timer, an event wait) → CANCELLED now,
        cause ``operator``; executing → asked to stop, CANCELLED when its worker stops. What
        only it fed is then cancelled (cause ``upstream``) as after a death, and ``run_if``
        dependents follow their conditions. Audited. Refused (:class:`WrongStateError`) for a
        finished task, a RUNNING map, or one asked to stop already; :class:`NotFoundError` for
        an unknown id."""
        return self._act(Action.CANCEL, task_run_id, requested_by, reason)

    def retry_task_now(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """A RETRYING task → READY at once (its backoff skipped, its outbox row written): the
        attempt it waited for is made now, none is added. Audited. Any other state is refused
        (:class:`WrongStateError`)."""
        return self._act(Action.RETRY_NOW, task_run_id, requested_by, reason)

    def bury_task(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """Bury one task by hand: DEAD, failure reason ``operator`` — at once when nothing
        executes it; when a worker does, it is asked to stop and goes DEAD when it stops (a
        handler that finishes first wins). Then it is a DEAD task like any other: ``on_dead``,
        fail-fast, requeue. Audited; refused as :meth:`cancel_task` is."""
        return self._act(Action.BURY, task_run_id, requested_by, reason)

    def key_holds(self, key: str) -> tuple[KeyHold, ...]:
        """What holds ``key``: one :class:`KeyHold` per kind of limit the key is (ordering,
        concurrency), with the task(s) holding it, why, and how many wait behind them. Empty
        when nothing holds it (an unknown key included)."""
        check_text(key, "the key", MAX_KEY_BYTES)
        return self._transaction(_key_holds, key)

    def _act(
        self, action: Action, task_run_id: UUID | str, requested_by: str, reason: str | None
    ) -> Controlled:
        tid = parse_id(task_run_id, "task run id")
        transitions.check(
            (*NOT_STARTED_TASK_STATES, TaskState.RUNNING)
            if action is not Action.RETRY_NOW
            else (TaskState.RETRYING,),
            TARGET[action],
        )
        check_note(requested_by, reason, f"the {action.replace('_', '-')} reason")
        done = self._transaction(_control, action, tid, requested_by, reason)
        logger.info(  # after the commit: a retried transaction logs once
            "%s of task run %s (%s) by %r: %s%s",
            action.replace("_", "-"),
            tid,
            done.previous_state,
            requested_by,
            done.task.state,
            ", asked to stop" if done.effect is Effect.STOP else "",
            extra={"action": f"task_{action}", "task_run_id": str(tid)},
        )
        return done


def _control(
    tx: Tx, action: Action, tid: UUID, requested_by: str, reason: str | None
) -> Controlled:
    row = tx.one("control_facts", {"id": tid})
    if row is None:
        raise NotFoundError(f"no task run with id {tid}")
    state = TaskState(row["state"])
    facts = TaskFacts(state, row["needs_worker"], row["is_map"], row["cancel_requested"])
    effect = plan(action, tid, facts)
    where = {"id": tid, "state": str(state), "token": row["fencing_token"]}
    details: dict[str, Any] = {}
    if action is Action.RETRY_NOW:
        changed = tx.one("retry_task_now", where)
        details["retry_at"] = None if row["retry_at"] is None else row["retry_at"].isoformat()
    elif effect is Effect.NOW:
        target = TARGET[action]
        failure = FailureReason.CANCELLED if action is Action.CANCEL else FailureReason.OPERATOR
        changed = tx.one("end_task", {**where, "target": str(target), "reason": str(failure)})
    else:
        changed = tx.one("request_task_stop", {**where, "bury": action is Action.BURY})
        details["stop_requested"] = True
    if changed is None:  # it moved since we read it: refuse, naming where it went
        now = tx.one("task_state", {"id": tid})
        went = "gone" if now is None else now["state"]
        raise WrongStateError(
            f"task run {tid} changed while it was being {_PAST[action]} (was {state}, now "
            f"{went}): nothing done"
        )
    if effect is Effect.STOP:
        new_state = state
    elif action is Action.RETRY_NOW:  # READY, or a child-workflow task's retry due now
        new_state = TaskState(changed["state"])
    else:
        new_state = TARGET[action]
        if state is TaskState.RUNNING and row["child_run_id"] is not None:
            cancel_child_runs(tx, [row["child_run_id"]], depth=1)  # a running child task's run
    tx.all(
        "insert_task_audit",
        {
            "id": tid,
            "run_id": row["run_id"],
            "action": str(action),
            "by": requested_by,
            "reason": reason,
            "previous_state": str(state),
            "new_state": str(new_state),
            "attempt": row["attempt"],
            "details": Jsonb(details),
        },
    )
    if effect is Effect.STOP:  # its worker hears it at the commit; lease renewal is the fallback
        tx.all("notify_task_cancel", {"id": tid})
    elif action is Action.RETRY_NOW:
        tx.all("notify_outbox" if new_state is TaskState.READY else "notify_scheduler")
    else:
        derive_states(tx, [row["run_id"]])
        tx.all("notify_scheduler")  # propagate: dependents, conditions, fail-fast
    return Controlled(action, task_by_id(tx, tid), state, effect)


_PAST = {Action.CANCEL: "cancelled", Action.RETRY_NOW: "retried", Action.BURY: "buried"}


def _key_holds(tx: Tx, key: str) -> tuple[KeyHold, ...]:
    """Both kinds of hold of ``key``, read in one transaction."""
    found = tx.all("key_stream", {"key": key, "limit": 1 + KEY_NEXT_SHOWN})
    slots = tx.all("concurrency_holds", {"key": key, "limit": KEY_SLOTS_SHOWN + KEY_NEXT_SHOWN})
    rate = tx.all("rate_holds", {"key": key, "limit": KEY_SLOTS_SHOWN + KEY_NEXT_SHOWN})
    return _ordering_hold(key, found) + _concurrency_hold(key, slots) + _rate_hold(key, rate)


def _ordering_hold(key: str, found: list[Row]) -> tuple[KeyHold, ...]:
    if not found:
        return ()
    first = found[0]
    holder = rows.key_task(
        first,
        why_holds(
            TaskState(first["state"]),
            first["on_dead"],
            first["pending_deps"],
            first["cancel_requested"],
        ),
    )
    behind = why_waits(f"{holder.name} of run {holder.run_id} ({holder.state})")
    return (
        KeyHold(
            kind=HoldKind.ORDERING,
            key=key,
            limit=1,
            holders=(holder,),
            waiting=int(first["n"]) - 1,
            next=tuple(rows.key_task(r, behind) for r in found[1:]),
        ),
    )


def _concurrency_hold(key: str, found: list[Row]) -> tuple[KeyHold, ...]:
    """``concurrency_holds`` rows (holders first) as a hold: its limit is the smallest of its
    tasks' (what admit_gated applies), at most KEY_SLOTS_SHOWN holders and
    KEY_NEXT_SHOWN waiting ones listed."""
    if not found:
        return ()
    limit = min(int(r["concurrency_limit"]) for r in found)
    held = [r for r in found if r["holds"]]
    free = limit - int(found[0]["held"])
    holders = tuple(
        rows.key_task(r, why_holds_slot(TaskState(r["state"]), r["cancel_requested"])) for r in held
    )
    waiting = [r for r in found if not r["holds"]][:KEY_NEXT_SHOWN]
    return (
        KeyHold(
            kind=HoldKind.CONCURRENCY,
            key=key,
            limit=limit,
            holders=holders,
            waiting=int(found[0]["waiting"]),
            next=tuple(
                rows.key_task(r, why_waits_slot(TaskState(r["state"]), r["pending_deps"], free))
                for r in waiting
            ),
        ),
    )


def _rate_hold(key: str, found: list[Row]) -> tuple[KeyHold, ...]:
    """``rate_holds`` rows (READY and RUNNING first) as a hold: its rule is the strictest of its
    tasks' (the smallest limit, the longest window: what admit_gated applies)."""
    if not found:
        return ()
    limit = min(int(r["rate_limit"]) for r in found)
    per_s = max(float(r["rate_per_s"]) for r in found)
    started = int(found[0]["started"])
    room = limit - int(found[0]["ready"]) - started
    holders = tuple(
        rows.key_task(r, why_holds_rate(TaskState(r["state"]), r["cancel_requested"]))
        for r in found
        if r["holds"]
    )[:KEY_SLOTS_SHOWN]
    waiting = [r for r in found if not r["holds"]][:KEY_NEXT_SHOWN]
    return (
        KeyHold(
            kind=HoldKind.RATE_LIMIT,
            key=key,
            limit=limit,
            holders=holders,
            waiting=int(found[0]["waiting"]),
            next=tuple(
                rows.key_task(r, why_waits_rate(TaskState(r["state"]), r["pending_deps"], room))
                for r in waiting
            ),
            per_s=per_s,
            started=started,
        ),
    )
