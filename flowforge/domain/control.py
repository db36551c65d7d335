"""An operator's control of one task (SPEC 7.4; docs/flow-control.md "Controlling single tasks"):
what each action does to a task in each state, and what holds an ordering key. Pure: the store
reads the facts, asks :func:`plan`, and applies the answer with conditional SQL (state and
fencing token), so a task that moved meanwhile is refused, never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from uuid import UUID

from flowforge.domain.model import TaskRun
from flowforge.domain.states import FINISHED_TASK_STATES, NOT_STARTED_TASK_STATES, TaskState
from flowforge.errors import WrongStateError


class Action(StrEnum):
    """An operator's action on one task; the spelling is stored in ``task_audit.action``."""

    CANCEL = "cancel"  # → CANCELLED (cause operator); dependents as after a death
    RETRY_NOW = "retry_now"  # a RETRYING task → READY at once, its backoff skipped
    BURY = "bury"  # → DEAD, failure reason operator; then as any DEAD task


#: The state each action ends a task in.
TARGET: dict[Action, TaskState] = {
    Action.CANCEL: TaskState.CANCELLED,
    Action.RETRY_NOW: TaskState.READY,
    Action.BURY: TaskState.DEAD,
}


class Effect(StrEnum):
    """How an accepted action takes effect."""

    NOW = "now"  # in the operator's transaction: the task is in its target state at the commit
    STOP = "stop"  # a worker executes it: it is asked to stop, and ends so when its worker stops


@dataclass(frozen=True)
class TaskFacts:
    """What :func:`plan` needs to know of a task, as last committed."""

    state: TaskState
    needs_worker: bool  # not a durable timer, a map or an event wait (docs/architecture.md)
    is_map: bool  # a for_each task (its items are the tasks workers execute)
    cancel_requested: bool  # its run or an operator asked it to stop already


def plan(action: Action, task_run_id: UUID, facts: TaskFacts) -> Effect:
    """How ``action`` takes effect on the task, or :class:`WrongStateError` naming its state.

    Cancel and bury end a task not started (PENDING, READY, RETRYING, FAILED) at once, and a
    RUNNING task no worker executes (a sleeping timer, an event wait) too; a RUNNING task a
    worker executes is asked to stop (once: a second request is refused) and ends CANCELLED,
    or DEAD ``operator`` for a bury, when its worker stops (a handler that finishes first
    wins). A RUNNING map is refused: its items are the tasks to act on (or its run). Retry-now
    takes a RETRYING task only. A finished task (SUCCEEDED, DEAD, CANCELLED) is refused by all.
    """
    state = facts.state
    if action is Action.RETRY_NOW:
        if state is TaskState.RETRYING:
            return Effect.NOW
        raise WrongStateError(
            f"task run {task_run_id} is {state}: only a RETRYING task can be retried now"
        )
    verb = "cancelled" if action is Action.CANCEL else "buried"
    if state in FINISHED_TASK_STATES:
        raise WrongStateError(
            f"task run {task_run_id} is {state}: a finished task cannot be {verb}"
        )
    if state in NOT_STARTED_TASK_STATES:
        return Effect.NOW
    assert state is TaskState.RUNNING
    if facts.is_map:
        raise WrongStateError(
            f"task run {task_run_id} is a RUNNING map: its items are what runs; cancel or bury "
            "them (flowforge items), or cancel the run"
        )
    if not facts.needs_worker:  # a sleeping timer or an event wait: nothing executes it
        return Effect.NOW
    if facts.cancel_requested:
        raise WrongStateError(
            f"task run {task_run_id} is RUNNING and already asked to stop: it cannot be {verb} "
            "again until it stops"
        )
    return Effect.STOP


@dataclass(frozen=True)
class Controlled:
    """What an action did: the task after it (read in the action's transaction), the state it
    was in before, and how the action took effect (STOP: the task is still RUNNING, asked to
    stop)."""

    action: Action
    task: TaskRun
    previous_state: TaskState
    effect: Effect


# ------------------------------------------------------------------ what holds a key


class HoldKind(StrEnum):
    """What kind of limit a key is (SPEC 7.4): an ordering stream (limit 1, in order), a
    concurrency key (``limit`` READY or RUNNING at once) or a rate key (``limit`` starts per
    window). One text may be all three."""

    ORDERING = "ordering"
    CONCURRENCY = "concurrency"
    RATE_LIMIT = "rate_limit"


@dataclass(frozen=True)
class KeyTask:
    """A task of a key's stream that is not done with it, with why it holds or waits."""

    id: UUID
    run_id: UUID
    workflow: str
    name: str
    state: TaskState
    failure_reason: str | None
    on_dead: str
    created_at: datetime
    why: str


@dataclass(frozen=True)
class KeyHold:
    """One limit of ``key``: ``limit`` tasks may hold it at once (1 for an ordering key);
    ``holders`` hold it now, ``waiting`` counts the tasks behind them and ``next`` lists the
    first few of those, in stream order. A rate key's hold also has its window (``per_s``) and
    ``started``, the attempts of its tasks started within it; its holders are its READY tasks
    (admitted: each will start, and counts in the window) and RUNNING ones."""

    kind: HoldKind
    key: str
    limit: int
    holders: tuple[KeyTask, ...]
    waiting: int
    next: tuple[KeyTask, ...]
    per_s: float | None = None
    started: int | None = None


def why_holds(state: TaskState, on_dead: str, pending_deps: int, cancel_requested: bool) -> str:
    """Why a task that holds an ordering stream (the oldest of it not done) keeps it."""
    if state is TaskState.DEAD:
        assert on_dead == "block"  # a DEAD task with on_dead: release holds nothing
        return "DEAD with on_dead: block — requeue, rerun or purge it to release the stream"
    if state is TaskState.RUNNING:
        return "running; asked to stop" if cancel_requested else "running"
    if state is TaskState.PENDING:
        if pending_deps:
            return f"waiting for {pending_deps} dependenc{'y' if pending_deps == 1 else 'ies'}"
        return "next to run: the scheduler makes it READY"
    if state is TaskState.READY:
        return "READY: waiting for a worker"
    if state is TaskState.RETRYING:
        return "RETRYING: waiting out its backoff"
    return f"{state}: its failure is being routed"


def why_waits(holder: str) -> str:
    """Why a task behind the holder waits."""
    return f"behind {holder} in the stream"


def why_holds_slot(state: TaskState, cancel_requested: bool) -> str:
    """Why a task holds a slot of a concurrency key (it is READY or RUNNING)."""
    if state is TaskState.RUNNING:
        return "running; asked to stop" if cancel_requested else "running"
    return "READY: admitted, waiting for a worker"


def why_holds_rate(state: TaskState, cancel_requested: bool) -> str:
    """Why a task of a rate key is listed among its holders (READY or RUNNING)."""
    if state is TaskState.RUNNING:
        return "running (its start counts in the window)" + (
            "; asked to stop" if cancel_requested else ""
        )
    return "READY: admitted, counts in the window until it starts"


def why_waits_rate(state: TaskState, pending_deps: int, room: int) -> str:
    """Why a task of a rate key waits (PENDING or RETRYING); ``room``: the key's limit less its
    READY tasks and its starts within the window."""
    if state is TaskState.PENDING and pending_deps:
        return f"waiting for {pending_deps} dependenc{'y' if pending_deps == 1 else 'ies'}"
    if room > 0:
        return "next to run: the scheduler admits it"
    what = "its retry waits" if state is TaskState.RETRYING else "waits"
    return f"{what} for room in the key's window"


def why_waits_slot(state: TaskState, pending_deps: int, free: int) -> str:
    """Why a task of a concurrency key waits (it is PENDING or RETRYING); ``free``: the key's
    slots not held now."""
    if state is TaskState.PENDING and pending_deps:
        return f"waiting for {pending_deps} dependenc{'y' if pending_deps == 1 else 'ies'}"
    if free > 0:
        return "next to run: the scheduler admits it"
    what = "its retry waits" if state is TaskState.RETRYING else "waits"
    return f"{what} for a free slot of the key"
