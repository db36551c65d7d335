"""The broker's turn during a chain (flowforge/roles/intake.py ``Intake.owed``), through the stub
broker and the fake store: served at once without a take when nothing waits for this worker,
so its continuation stays with it; taken, with the continuation sent out as a message, when a
delivery waits, the consumer is paused, or the window was full until just now.

The same worker through real RabbitMQ and PostgreSQL: tests/integration/test_worker_batches.py
(a chain continues on the worker that released each step).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from uuid import UUID

import pytest

from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError
from flowforge.roles import intake
from flowforge.roles.intake import Intake
from tests.stubs import StubBroker
from tests.unit.test_worker_loop import Rig, make_rig


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every finish comes at the broker's turn; an ack does not hold the turn back."""
    monkeypatch.setattr(intake, "PUMP_INTERVAL_S", 0.0)
    monkeypatch.setattr(intake, "ACK_SETTLE_S", 0.0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.worker.shutdown()


def _chain(rig: Rig, length: int) -> list[UUID]:
    steps = rig.store.add("fast", length, state=TaskState.PENDING)
    rig.store.tasks[steps[0]].state = TaskState.READY
    for before, after in itertools.pairwise(steps):
        rig.store.then(before, after)
    rig.broker.publish(steps[0], 1)
    return steps


@pytest.mark.usefixtures("turns")
def test_at_the_turn_with_nothing_waiting_the_chain_stays_on_the_worker(rig: Rig) -> None:
    steps = _chain(rig, 4)
    rig.run()
    assert rig.ran == steps
    assert rig.broker.takes() == [1]  # the first step's only: the turns found nothing
    assert rig.store.count("claim_many") == 1  # every other step claimed by a finish
    assert rig.trace("waiting") == ["waiting"] * 4  # at each finish, served at once


@pytest.mark.usefixtures("turns")
def test_at_the_turn_a_delivery_waiting_is_taken_and_the_continuation_goes_out(
    rig: Rig,
) -> None:
    first, second = _chain(rig, 2)
    [other] = rig.publish("fast")  # behind the chain's first step in the queue
    rig.run()
    assert rig.ran == [first, other]
    step = rig.store.tasks[second]
    assert (step.state, step.attempt) == (TaskState.READY, 0)  # released: out as a message


def test_right_after_an_ack_the_turn_is_a_take(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window was full until the ack: what the broker pushes now is not here yet."""
    monkeypatch.setattr(intake, "PUMP_INTERVAL_S", 0.0)
    monkeypatch.setattr(intake, "ACK_SETTLE_S", 60.0)
    first, second = _chain(rig, 2)
    rig.run()
    assert rig.ran == [first]
    assert rig.trace("waiting") == []  # the broker was not asked: it is owed a take
    step = rig.store.tasks[second]
    assert (step.state, step.attempt) == (TaskState.READY, 0)


def test_a_turn_not_due_asks_nothing_of_the_broker() -> None:
    broker = StubBroker()
    broker.connect()
    turn = Intake(broker, prefetch=8, fast_s=0.05)
    turn.take(1, 0.0)
    assert not turn.owed()
    assert [name for name, _ in broker.events] == ["connect", "take"]


def test_a_paused_consumer_owes_a_take_whatever_its_buffers_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(intake, "PUMP_INTERVAL_S", 0.0)
    broker = StubBroker()
    broker.connect()
    turn = Intake(broker, prefetch=8, fast_s=0.05)
    turn.take(1, 0.0)
    turn.hand_back()  # a slow handler: consuming stops
    assert turn.owed() and turn.owed()  # never served without a take
    turn.take(1, 0.0)  # consuming again, nothing waiting
    assert not turn.owed()


def test_a_broker_lost_at_the_turn_is_kept_as_broken_and_owes_the_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(intake, "PUMP_INTERVAL_S", 0.0)
    broker = StubBroker()
    broker.connect()
    turn = Intake(broker, prefetch=8, fast_s=0.05)
    turn.take(1, 0.0)
    broker.connected = False
    assert turn.owed()
    assert isinstance(turn.broken, BrokerUnavailableError)
