"""The worker's delivery guarantees through its seams: what tests/integration/
test_roles_delivery.py, test_worker_batches.py and test_recycle.py prove with real role
processes, real RabbitMQ, PostgreSQL and signals (marked ``slow``), here in milliseconds on the real
:class:`~flowforge.roles.worker.Worker` loop over :class:`tests.stubs.StubBroker` and
:class:`tests.stubs.FakeStore` (the rig of tests/unit/test_worker_loop.py).

A signal reaches a role as its stop event (flowforge/roles/runner.py), so "SIGTERM while a
handler runs" is the stop event set while the handler runs. What the statements themselves
guarantee (a stale token claims nothing, one finish per token, the reaper) is proven against
PostgreSQL in tests/integration/test_batch_transitions.py, test_concurrency.py and
test_transitions.py.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import pytest

from flowforge.config import ProcessesConfig
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError, PermanentError
from flowforge.roles import batch
from flowforge.roles.context import TaskContext
from flowforge.roles.intake import PUMP_INTERVAL_S
from tests.unit.test_worker_loop import Rig, make_rig, rig

_ = rig  # the fixture, shared with tests/unit/test_worker_loop.py


# ------------------------------------------------------------------ redeliveries


def test_a_redelivery_of_a_task_another_worker_holds_is_acked_without_running(rig: Rig) -> None:
    """A lost ack: the broker redelivers a dispatch whose claim committed elsewhere."""
    [held] = rig.store.add("fast")
    rig.store.tasks[held].state, rig.store.tasks[held].token = TaskState.RUNNING, 2
    rig.broker.publish(held, 1)  # the message names the generation that was claimed
    rig.run()
    assert rig.ran == []
    assert rig.broker.acks() == [1] and rig.broker.unacked == 0
    assert rig.store.count("finish_many") == 0
    task = rig.store.tasks[held]
    assert (task.state, task.token) == (TaskState.RUNNING, 2)  # the holder still owns it


def test_a_duplicate_delivery_within_one_batch_runs_the_handler_once(rig: Rig) -> None:
    [first] = rig.publish("fast")  # the window grows to 2 after this batch
    [twice] = rig.store.add("fast")
    for _ in range(2):  # e.g. a publisher that re-published after a lost confirm
        rig.broker.publish(twice, 1)
    rig.run()
    assert rig.broker.takes() == [1, 2]  # both copies came in one batch
    assert rig.ran == [first, twice]
    assert rig.broker.acks() == [1, 3] and rig.broker.unacked == 0
    assert rig.store.tasks[twice].state is TaskState.SUCCEEDED
    assert rig.telemetry.stale_completions.value() == 0


# ------------------------------------------------------------------ stopping, slow handlers


def test_a_stop_while_a_handler_runs_finishes_its_task_acks_it_and_takes_no_more() -> None:
    made = make_rig()

    def interrupted(ctx: TaskContext) -> dict[str, bool]:
        assert made.store.processes, "the worker registered before it took work"
        made.stop.set()  # SIGTERM arrives while the handler runs
        return {"finished": True}

    made.worker._handlers = {**(made.worker._handlers or {}), "interrupted": interrupted}
    [task] = made.publish("interrupted")
    [waiting] = made.publish("fast")
    try:
        made.run()
        finish = made.store.tasks[task].finish
        assert made.store.tasks[task].state is TaskState.SUCCEEDED
        assert finish is not None and json.loads(finish.result) == {"finished": True}
        assert made.broker.acks() == [1] and made.broker.unacked == 0
        assert made.broker.takes() == [1]  # nothing taken after the stop
        assert made.store.tasks[waiting].state is TaskState.READY and made.ran == []
    finally:
        made.worker.shutdown()
    assert made.store.processes == set()  # deregistered on the way out
    assert made.broker.queue and not made.broker.connected  # the rest stays queued


def test_a_slow_handler_alone_in_its_batch_finishes_and_the_worker_consumes_again() -> None:
    made = make_rig(fast_ms=50.0)

    def slow(ctx: TaskContext) -> dict[str, float]:
        time.sleep(0.2)  # the handler's own work: four times fast_handler_ms
        return {"slept": 0.2}

    made.worker._handlers = {**(made.worker._handlers or {}), "slow": slow}
    [held] = made.publish("slow")
    [after] = made.publish("fast")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.trace("take", "hand_back")[:2] == ["take", "hand_back"]  # consumer stopped
    assert made.broker.takes() == [1, 1]  # and started again for the next delivery
    assert made.store.count("release_claims") == 0  # nothing was behind it
    assert made.store.tasks[held].state is TaskState.SUCCEEDED
    assert made.store.tasks[held].attempt == 1
    assert made.ran == [after] and made.broker.unacked == 0


def test_while_a_long_handler_runs_the_broker_connection_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heartbeats: the main thread serves the connection every ``PUMP_INTERVAL_S`` (1 s; a
    twentieth of it here, so the handler need not run for seconds) however long the handler
    runs, on the connection it has."""
    interval = PUMP_INTERVAL_S / 20
    monkeypatch.setattr(batch, "PUMP_INTERVAL_S", interval)
    made = make_rig(fast_ms=50.0)
    served_while_running: list[float] = []
    running = threading.Event()
    real_pump = made.broker.pump

    def pump(time_limit_s: float = 0.0) -> None:
        if running.is_set():
            served_while_running.append(time.monotonic())
        real_pump(time_limit_s)

    made.broker.pump = pump  # type: ignore[method-assign]

    def long(ctx: TaskContext) -> str:
        running.set()
        time.sleep(10 * interval)  # the handler's own work: ten intervals
        running.clear()
        return "done"

    made.worker._handlers = {**(made.worker._handlers or {}), "long": long}
    [task] = made.publish("long")
    [after] = made.publish("fast")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert len(served_while_running) >= 3, served_while_running
    gaps = [b - a for a, b in itertools.pairwise(served_while_running)]
    assert max(gaps) < 10 * interval, gaps  # served all along, not once at the end
    assert made.store.tasks[task].state is TaskState.SUCCEEDED
    assert made.ran == [after]  # the same connection still consumes
    assert [name for name, _ in made.journal if name == "connect"] == ["connect"]


# ------------------------------------------------------------------ failures and their reasons


def _always_fails(ctx: TaskContext) -> None:
    raise RuntimeError("this handler always fails")


def _permanent(ctx: TaskContext) -> None:
    raise PermanentError("this input can never work")


def _unserializable(ctx: TaskContext) -> Any:
    return {"when": object()}


@pytest.mark.parametrize(
    ("handler", "reason", "error"),
    [
        (_always_fails, FailureReason.HANDLER_ERROR, "RuntimeError: this handler always fails"),
        (_permanent, FailureReason.PERMANENT_ERROR, "PermanentError: this input can never work"),
        (_unserializable, FailureReason.UNSERIALIZABLE_RESULT, "the handler's result"),
    ],
    ids=["error", "permanent", "unserializable"],
)
def test_a_failing_handler_finishes_its_task_failed_with_the_reason_and_its_error(
    rig: Rig, handler: Any, reason: FailureReason, error: str
) -> None:
    rig.worker._handlers = {**(rig.worker._handlers or {}), "failing": handler}
    [task] = rig.publish("failing")
    [after] = rig.publish("fast")
    rig.run()
    finish = rig.store.tasks[task].finish
    assert finish is not None
    assert (finish.state, finish.reason) == (TaskState.FAILED, reason)
    assert finish.error is not None and finish.error.startswith(error), finish.error
    if reason is not FailureReason.UNSERIALIZABLE_RESULT:  # a raise has its traceback
        assert finish.traceback is not None and error.split(": ", 1)[1] in finish.traceback
    assert rig.ran == [after]  # the worker carries on
    assert not rig.worker.recycle


# ------------------------------------------------------------------ the next step of a DAG


def test_a_finish_after_the_broker_connection_broke_leaves_the_next_step_to_the_outbox(
    rig: Rig,
) -> None:
    """The ack fails: the worker will reconnect after the batch, so its finish must not claim
    step b for itself (the reconnect would strand the claim until its lease lapsed)."""
    a, b = rig.store.add("fast", 2, state=TaskState.PENDING)
    rig.store.tasks[a].state = TaskState.READY
    rig.store.then(a, b)
    rig.broker.publish(a, 1)
    rig.broker.fail_acks = 1
    with pytest.raises(BrokerUnavailableError):
        rig.run()
    assert rig.ran == [a] and rig.store.tasks[a].state is TaskState.SUCCEEDED
    step = rig.store.tasks[b]
    assert (step.state, step.attempt) == (TaskState.READY, 0)  # released, not claimed


def test_a_worker_over_its_memory_limit_finishes_the_task_then_asks_to_be_recycled() -> None:
    made = make_rig(processes=ProcessesConfig(max_memory_mb_per_child=1))  # any process is over
    [task] = made.publish("fast")
    [waiting] = made.publish("fast")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.worker.recycle and made.finished.count == 1
    assert made.ran == [task] and made.store.tasks[task].state is TaskState.SUCCEEDED
    assert made.store.tasks[waiting].state is TaskState.READY  # left for another worker


def test_a_worker_recycled_right_after_its_finish_claimed_the_next_step_hands_it_back() -> None:
    """The finish of a claims b for this worker in its own transaction; the memory check right
    after it asks for a recycle: b goes back to READY (attempt un-counted, a new outbox row)
    before the worker exits, so another worker runs it at once, not after b's lease."""
    made = make_rig(processes=ProcessesConfig(max_memory_mb_per_child=1))
    released: list[tuple[Any, int]] = []
    made.store.on_release = lambda task, token: released.append((task, token))
    a, b = made.store.add("fast", 2, state=TaskState.PENDING)
    made.store.tasks[a].state = TaskState.READY
    made.store.then(a, b)
    made.broker.publish(a, 1)
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.worker.recycle and made.ran == [a]
    step = made.store.tasks[b]
    assert (step.state, step.attempt) == (TaskState.READY, 0)
    assert released == [(b, step.token)]  # a new generation: the outbox row
    assert made.store.count("claim_many") == 1  # a's: b was claimed by a's finish
    assert made.trace("finish_many", "release_claims") == ["finish_many", "release_claims"]
