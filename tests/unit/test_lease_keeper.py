"""When the lease keeper thread is woken (flowforge/roles/lease.py), through a fake repository.

A claim held while the keeper already waits for a renewal must not wake it (a thread switch at
every step of a chain: docs/performance.md "The worker's side of a hop"); one held while it
waits without end (nothing held) must, or its lease would never be renewed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import cast
from uuid import UUID, uuid4

import pytest

from flowforge.domain.model import Claim
from flowforge.roles.context import TaskContext
from flowforge.roles.lease import Leases
from flowforge.roles.seams import WorkerStore
from tests.helpers import wait_for


class _Claim:
    def __init__(self) -> None:
        self.task_run_id = uuid4()
        self.run_id = uuid4()
        self.fencing_token = 1


class _Repo:
    def __init__(self) -> None:
        self.renewed: list[list[UUID]] = []

    def renew_leases(self, pairs: list[tuple[UUID, int]], lease_s: float) -> dict[UUID, bool]:
        self.renewed.append([task_run_id for task_run_id, _ in pairs])
        return {task_run_id: False for task_run_id, _ in pairs}


class _CountingEvent(threading.Event):
    """The keeper's wake event, counting the wakes asked for and the keeper's timed waits
    (it waits with a timeout only while it holds something)."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0
        self.timed_waits = 0

    def set(self) -> None:
        self.sets += 1
        super().set()

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
        return super().wait(timeout)


def _hold(leases: Leases) -> _Claim:
    claim = _Claim()
    ctx = TaskContext({}, {}, 1, claim.task_run_id, claim.run_id, "t")
    leases.hold([(cast(Claim, claim), ctx)])
    return claim


@pytest.fixture
def keeper() -> Iterator[tuple[Leases, _Repo, _CountingEvent]]:
    repo = _Repo()
    leases = Leases(cast(WorkerStore, repo), lease_s=3.0, heartbeat_s=1.0, output_flush_s=60)
    wake = _CountingEvent()
    leases._wake = wake  # the seam: count the wakes the keeper is asked for
    leases.start()
    try:
        yield leases, repo, wake
    finally:
        leases.stop()


def _idle(leases: Leases) -> bool:
    return leases._idle


def test_a_hold_wakes_the_keeper_waiting_with_nothing_held_and_its_lease_is_renewed(
    keeper: tuple[Leases, _Repo, _CountingEvent],
) -> None:
    leases, repo, wake = keeper
    wait_for(lambda: _idle(leases), what="the keeper waiting with nothing held")
    claim = _hold(leases)
    assert wake.sets == 1
    wait_for(lambda: repo.renewed, timeout=5.0, what="a renewal")
    assert repo.renewed[0] == [claim.task_run_id]


def test_a_hold_while_the_keeper_waits_for_a_renewal_does_not_wake_it(
    keeper: tuple[Leases, _Repo, _CountingEvent],
) -> None:
    leases, repo, wake = keeper
    wait_for(lambda: _idle(leases), what="the keeper waiting with nothing held")
    first = _hold(leases)
    wait_for(lambda: wake.timed_waits, what="the keeper waiting for the renewal")
    # a chain's steps: each finish drops the last claim, the next claim holds a new one
    for _ in range(20):
        leases.drop([first.task_run_id])
        first = _hold(leases)
    assert wake.sets == 1
    wait_for(lambda: repo.renewed, timeout=5.0, what="a renewal")
    assert repo.renewed[0] == [first.task_run_id]  # the one held now, renewed in time
