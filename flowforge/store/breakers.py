"""Circuit breakers and pauses (SPEC 7.4; docs/flow-control.md "Circuit breakers and pauses").

The gate is at the claim, the only way into execution: a task whose handler's breaker is open,
or whose queue or handler is paused, is not claimed but parked (queries.sql ``claim``: READY →
RETRYING with no retry time, no attempt used, its token bumped: ``park``). Nothing else on the
hot path reads a breaker: a breaker opens in the transaction of the finish of the failure that
reaches its threshold (``trip_breakers``, run by ``Claims.finish_many`` only for a batch with a
handler failure).

:class:`Gates` is the scheduler's side — probes, lost probes, unparking, and the transitions to
log — and the operator's: open or close a breaker, pause or resume a queue or a handler, each
audited (``gate_audit``, read by the ``operator_actions`` view) in the statement that acts.
"""

from __future__ import annotations

from flowforge.domain.breakers import (
    Breaker,
    BreakerGauge,
    BreakerState,
    GateChange,
    GateGauges,
    GatePass,
    Pause,
    PauseScope,
    Transition,
    breaker_name,
    check_breaker_key,
    check_handler_name,
    check_pause_target,
)
from flowforge.domain.values import check_note
from flowforge.errors import NotFoundError, WrongStateError
from flowforge.store.db import Row
from flowforge.store.part import Part, Tx


class Gates(Part):
    """Breakers and pauses: the scheduler's pass and the operator's actions."""

    def pass_gates(self, limit: int) -> GatePass:
        """One transaction: half-open breakers whose probe succeeded close, those whose probe can
        no longer answer reopen; open breakers whose cooldown is over take one parked task
        each as their probe; parked tasks nothing holds any more (up to ``limit``) get a retry
        time of now, for promote_ready (or the admission pass) to dispatch; and up to ``limit``
        transitions not logged yet are marked logged, for the caller to log once each
        (whichever tree made them, one scheduler takes them). When nothing is held, parked or
        unlogged, one statement finds that and the pass ends there."""
        return self._transaction(_pass_gates, limit)

    def breakers(self, handler: str | None = None, key: str | None = None) -> list[Breaker]:
        """Every breaker (or ``handler``'s: its handler-wide one and each key's; with ``key``,
        that key's only), with its recent failures, cooldown left, parked tasks and
        transitions. :class:`InputError` for a malformed handler name or key."""
        if handler is not None:
            check_handler_name(handler)
        if key is not None:
            check_breaker_key(key)
        params = {"handler": handler, "key": key}
        return [_breaker(r) for r in self._query("list_breakers", params)]

    def pauses(self) -> list[Pause]:
        """Every paused queue and handler, with the tasks parked under it."""
        return [_pause(r) for r in self._query("list_pauses")]

    def gauges(self) -> GateGauges:
        """``/metrics``: each breaker's state and transitions by target state, and the tasks
        parked now by why."""
        return self._transaction(_gauges)

    def open_breaker(
        self, handler: str, requested_by: str, reason: str | None, key: str | None = None
    ) -> GateChange:
        """Open ``handler``'s breaker (with ``key``: that key's breaker of the handler) by hand
        and hold it open (no probe) until closed by hand. A key need not have failed yet: its
        breaker is made open. :class:`InputError` for a malformed name or key (an empty key
        too: no key names the handler's breaker), :class:`NotFoundError` for a handler no
        workflow names, :class:`WrongStateError` when it is held open already. Audited."""
        check_note(requested_by, reason, "the reason")
        target = _target(handler, key)
        return self._transaction(_open, *target, requested_by, reason)

    def close_breaker(
        self, handler: str, requested_by: str, reason: str | None, key: str | None = None
    ) -> GateChange:
        """Close ``handler``'s breaker (with ``key``: that key's) by hand (from open, held open
        or half-open): its failures are forgotten and its parked tasks dispatched by the
        scheduler. :class:`WrongStateError` when it is closed (or has never opened).
        Audited."""
        check_note(requested_by, reason, "the reason")
        target = _target(handler, key)
        return self._transaction(_close, *target, requested_by, reason)

    def pause(self, scope: str, name: str, requested_by: str, reason: str | None) -> GateChange:
        """Pause a queue or a handler: from the commit, no task of it is claimed (each is parked,
        ``waiting_on: paused``); tasks already running finish. :class:`WrongStateError` when it
        is paused already; :class:`NotFoundError` for a handler no workflow names. Audited."""
        check_note(requested_by, reason, "the reason")
        kind, target = check_pause_target(scope, name)
        return self._transaction(_pause_target, kind, target, requested_by, reason)

    def resume(self, scope: str, name: str, requested_by: str, reason: str | None) -> GateChange:
        """Resume a paused queue or handler: its parked tasks are dispatched by the scheduler
        (those no other pause or breaker holds). :class:`WrongStateError` when it is not
        paused. Audited."""
        check_note(requested_by, reason, "the reason")
        kind, target = check_pause_target(scope, name)
        return self._transaction(_resume_target, kind, target, requested_by, reason)


def _pass_gates(tx: Tx, limit: int) -> GatePass:
    work = tx.one("gate_work")
    if work is None or not (work["breakers"] or work["parked"] or work["unlogged"]):
        return GatePass(0, ())
    unparked = 0
    if work["breakers"]:
        tx.all("settle_probes")  # before probing: a lost probe's breaker probes again now
        unparked += len(tx.all("probe_breakers", {"limit": limit}))
    if work["breakers"] or work["parked"]:  # a closing above may have freed parked tasks
        unparked += len(tx.all("unpark_tasks", {"limit": limit}))
    moved = tx.all("log_transitions", {"limit": limit})  # this pass's transitions too
    return GatePass(unparked, tuple(_transition(r) for r in moved))


def _target(handler: str, key: str | None) -> tuple[str, str]:
    """(handler, key) of an operator's breaker action, checked; key '' is the handler's."""
    return check_handler_name(handler), "" if key is None else check_breaker_key(key)


def _gauges(tx: Tx) -> GateGauges:
    return GateGauges(
        tuple(
            BreakerGauge(
                r["handler"],
                r["key"],
                BreakerState(r["state"]),
                {
                    BreakerState.OPEN: r["opened"],
                    BreakerState.HALF_OPEN: r["half_opened"],
                    BreakerState.CLOSED: r["closed"],
                },
            )
            for r in tx.all("breaker_gauges")
        ),
        {r["reason"]: r["n"] for r in tx.all("parked_counts")},
        {
            (r["handler"], BreakerState(r["to_state"])): r["n"]
            for r in tx.all("breaker_folded_transitions")
        },
    )


def _known(tx: Tx, handler: str) -> None:
    row = tx.one("known_handler", {"handler": handler})
    if row is None or not row["known"]:
        raise NotFoundError(f"no workflow names handler {handler!r}")


def _open(tx: Tx, handler: str, key: str, by: str, reason: str | None) -> GateChange:
    _known(tx, handler)
    params = {"handler": handler, "key": key, "by": by, "reason": reason}
    row = tx.one("open_breaker", params)
    if row is None:
        raise WrongStateError(f"the {breaker_name(handler, key)} is held open already")
    return GateChange(
        "breaker_open",
        "handler",
        handler,
        row["previous_state"],
        str(BreakerState.OPEN),
        key or None,
    )


def _close(tx: Tx, handler: str, key: str, by: str, reason: str | None) -> GateChange:
    _known(tx, handler)
    params = {"handler": handler, "key": key, "by": by, "reason": reason}
    row = tx.one("close_breaker", params)
    if row is None:
        raise WrongStateError(f"the {breaker_name(handler, key)} is closed already")
    return GateChange(
        "breaker_close",
        "handler",
        handler,
        row["previous_state"],
        str(BreakerState.CLOSED),
        key or None,
    )


def _pause_target(tx: Tx, scope: PauseScope, name: str, by: str, reason: str | None) -> GateChange:
    if scope is PauseScope.HANDLER:
        _known(tx, name)
    params = {"scope": str(scope), "name": name, "by": by, "reason": reason}
    if tx.one("pause", params) is None:
        raise WrongStateError(f"{scope} {name!r} is paused already")
    return GateChange("pause", str(scope), name, "running", "paused")


def _resume_target(tx: Tx, scope: PauseScope, name: str, by: str, reason: str | None) -> GateChange:
    params = {"scope": str(scope), "name": name, "by": by, "reason": reason}
    if tx.one("resume", params) is None:
        raise WrongStateError(f"{scope} {name!r} is not paused")
    return GateChange("resume", str(scope), name, "paused", "running")


def _transition(row: Row) -> Transition:
    return Transition(
        row["handler"],
        row["key"],
        BreakerState(row["from_state"]),
        BreakerState(row["to_state"]),
        row["cause"],
        row["at"],
    )


def _breaker(row: Row) -> Breaker:
    return Breaker(
        handler=row["handler"],
        key=row["key"],
        state=BreakerState(row["state"]),
        held=row["held"],
        recent_failures=row["recent_failures"],
        failures=row["failure_limit"],
        window_s=row["window_s"],
        cooldown_s=row["cooldown_s"],
        opened_at=row["opened_at"],
        probe_due_in_s=row["probe_due_in_s"],
        probe_task_id=None if row["probe_task_id"] is None else str(row["probe_task_id"]),
        parked=row["parked"],
        transitions=row["transitions"],
        updated_at=row["updated_at"],
    )


def _pause(row: Row) -> Pause:
    return Pause(
        PauseScope(row["scope"]),
        row["name"],
        row["paused_by"],
        row["reason"],
        row["paused_at"],
        row["parked"],
    )
