"""The legal task-run transitions, written as data.

Every state change in the store names its source and target states; :func:`check` is
called before any SQL runs, so an illegal request raises :class:`IllegalTransitionError`
instead of silently matching zero rows (which would look like a lost race).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flowforge.domain.states import TaskState as S
from flowforge.errors import IllegalTransitionError

TRANSITIONS: Mapping[S, frozenset[S]] = {
    # advance (dependencies met) / cancel / a durable timer starts sleeping, an event wait
    # starts or a map expands (no worker) / a map whose upstream result cannot be expanded is
    # buried / an event wait starts and finds its event stored already
    S.PENDING: frozenset({S.READY, S.CANCELLED, S.RUNNING, S.DEAD, S.SUCCEEDED}),
    # claim / defer (idempotency key busy) / cancel / re-dispatch a message the broker lost /
    # an operator's bury
    S.READY: frozenset({S.RUNNING, S.RETRYING, S.CANCELLED, S.READY, S.DEAD}),
    # finish (or a timer's wake) / reap (retry or bury) / honoured cancellation (or a sleeping
    # timer cancelled) / hand back an unstarted claim
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.RETRYING, S.DEAD, S.CANCELLED, S.READY}),
    # route by retry policy / cancel
    S.FAILED: frozenset({S.RETRYING, S.DEAD, S.CANCELLED}),
    # promote a due retry (or an operator's retry-now) / cancel / an operator's bury / a
    # child-workflow task's due retry starts its next child run (no worker), or is buried when
    # that child cannot be started
    S.RETRYING: frozenset({S.READY, S.CANCELLED, S.RUNNING, S.DEAD}),
    # audited requeue (or an audited rerun of its finished run)
    S.DEAD: frozenset({S.PENDING}),
    # revived by the requeue of the dead task that caused the cancellation (or by a rerun)
    S.CANCELLED: frozenset({S.PENDING}),
    # only an audited `rerun --from` of a finished run resets a success (and what follows it)
    S.SUCCEEDED: frozenset({S.PENDING}),
}


def is_legal(source: S, target: S) -> bool:
    """Whether ``source → target`` is a transition of the state machine."""
    return target in TRANSITIONS[source]


def check(sources: S | Iterable[S], target: S) -> None:
    """Raise :class:`IllegalTransitionError` unless every ``source → target`` is legal."""
    for source in (sources,) if isinstance(sources, S) else sources:
        if not is_legal(source, target):
            raise IllegalTransitionError(f"illegal task transition {source} -> {target}")
