"""How a cancellation reaches a held task (flowforge/roles/lease.py), through seams.

The real-process proofs (a cancel reaches a running handler within a second; with the
listener off, renewal still delivers it) are in tests/integration/test_cancel_delivery.py.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, cast
from uuid import UUID, uuid4

from flowforge.config import DatabaseConfig
from flowforge.domain.model import Claim
from flowforge.errors import DatabaseUnavailableError
from flowforge.roles import lease
from flowforge.roles.context import TaskContext
from flowforge.roles.lease import CancelWatch, Leases
from flowforge.roles.seams import WorkerStore
from flowforge.store.notify import CANCEL_CHANNEL
from tests.helpers import wait_for


class _Claim:
    def __init__(self, run_id: UUID) -> None:
        self.task_run_id = uuid4()
        self.run_id = run_id
        self.fencing_token = 1


class _Repo:
    """Renewal answers from a dict: task run id → cancel requested (missing: lease lost)."""

    def __init__(self) -> None:
        self.answer: dict[UUID, bool] = {}
        self.renewals = 0

    def renew_leases(self, pairs: list[tuple[UUID, int]], lease_s: float) -> dict[UUID, bool]:
        self.renewals += 1
        return {task_run_id: self.answer.get(task_run_id, False) for task_run_id, _ in pairs}


def _held(leases: Leases, run_id: UUID) -> tuple[_Claim, TaskContext]:
    claim = _Claim(run_id)
    ctx = TaskContext({}, {}, 1, claim.task_run_id, run_id, "t")
    leases.hold([(cast(Claim, claim), ctx)])
    return claim, ctx


def _leases(repo: _Repo, heartbeat_s: float = 30.0) -> Leases:
    return Leases(cast(WorkerStore, repo), lease_s=heartbeat_s * 3, heartbeat_s=heartbeat_s)


def test_cancel_run_sets_ctx_cancelled_of_the_held_tasks_of_that_run_only() -> None:
    leases = _leases(_Repo())
    run, other = uuid4(), uuid4()
    _, first = _held(leases, run)
    _, second = _held(leases, run)
    _, elsewhere = _held(leases, other)
    assert leases.cancel_run(run) == 2
    assert first.cancelled.is_set() and second.cancelled.is_set()
    assert not elsewhere.cancelled.is_set()
    assert leases.cancel_run(run) == 0  # asked once: a repeated notification changes nothing


def test_cancel_run_ignores_tasks_no_longer_held() -> None:
    leases = _leases(_Repo())
    run = uuid4()
    claim, ctx = _held(leases, run)
    leases.drop([claim.task_run_id])
    assert leases.cancel_run(run) == 0 and not ctx.cancelled.is_set()


def test_renewal_still_delivers_a_cancel_no_notification_announced() -> None:
    repo = _Repo()
    leases = _leases(repo, heartbeat_s=30.0)
    claim, ctx = _held(leases, uuid4())
    repo.answer[claim.task_run_id] = True
    leases.maybe_renew()
    assert repo.renewals == 0 and not ctx.cancelled.is_set()  # not due for 30 s
    leases.renew_soon()
    assert leases.due_in() == 0.0
    leases.maybe_renew()
    assert repo.renewals == 1 and ctx.cancelled.is_set()


class _FakeListener:
    """Stands in for :class:`Listener`: payloads come from a queue; ``fail`` opens fail."""

    attempts = 0
    opened: list[str] = []
    fail = threading.Event()
    payloads: queue.Queue[str] = queue.Queue()

    def __init__(self, config: DatabaseConfig, channel: str) -> None:
        self.channel = channel

    def open(self) -> None:
        _FakeListener.attempts += 1
        if self.fail.is_set():
            raise DatabaseUnavailableError("database unavailable: refused")
        self.opened.append(self.channel)

    def receive(self, timeout_s: float) -> list[str]:
        try:
            return [self.payloads.get(timeout=min(timeout_s, 0.05))]
        except queue.Empty:
            return []

    def close(self) -> None:
        pass


def _watch(leases: Leases) -> CancelWatch:
    _FakeListener.attempts = 0
    _FakeListener.opened = []
    _FakeListener.fail.clear()
    listener = cast(Any, _FakeListener)
    return CancelWatch(DatabaseConfig(), leases, listener=listener, rand=lambda: 0.0)


def test_a_notification_sets_ctx_cancelled_at_once_and_a_foreign_payload_is_ignored() -> None:
    leases = _leases(_Repo())
    run = uuid4()
    _, ctx = _held(leases, run)
    watch = _watch(leases)
    watch.start()
    watch.start()  # idempotent: one thread, one connection
    try:
        wait_for(lambda: _FakeListener.opened, timeout=5, what="the listener to connect")
        assert _FakeListener.opened == [CANCEL_CHANNEL]
        assert leases.due_in() == 0.0  # connected: a renewal reads what LISTEN missed
        _FakeListener.payloads.put("not a uuid")
        _FakeListener.payloads.put(str(uuid4()))
        _FakeListener.payloads.put(str(run))
        wait_for(ctx.cancelled.is_set, timeout=5, what="the notification to set ctx.cancelled")
    finally:
        watch.stop()


def test_the_watch_reconnects_after_a_failure_and_asks_for_a_renewal_again(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(lease, "LISTEN_POLL_S", 0.05)
    leases = _leases(_Repo())
    watch = _watch(leases)
    _FakeListener.fail.set()
    watch.start()
    try:
        wait_for(lambda: _FakeListener.attempts >= 1, timeout=5, what="a first attempt")
        assert leases.due_in() > 0  # never connected: no renewal forced
        _FakeListener.fail.clear()
        wait_for(lambda: _FakeListener.opened, timeout=5, what="the listener to reconnect")
        assert leases.due_in() == 0.0
    finally:
        watch.stop()


def test_a_task_notification_stops_that_held_task_only() -> None:
    """``task:<id>`` (an operator's cancel or bury of one task) stops that task, not its
    siblings of the same run; a malformed one is ignored."""
    leases = _leases(_Repo())
    run = uuid4()
    claim, named = _held(leases, run)
    _, sibling = _held(leases, run)
    assert leases.cancel_task(uuid4()) == 0  # not held here
    watch = _watch(leases)
    watch.start()
    try:
        wait_for(lambda: _FakeListener.opened, timeout=5, what="the listener to connect")
        _FakeListener.payloads.put(f"{lease.TASK_PREFIX}not a uuid")
        _FakeListener.payloads.put(f"{lease.TASK_PREFIX}{claim.task_run_id}")
        wait_for(named.cancelled.is_set, timeout=5, what="the named task to be asked to stop")
        assert not sibling.cancelled.is_set()
    finally:
        watch.stop()
    assert leases.cancel_task(claim.task_run_id) == 0  # asked once
