"""The worker's window follows what each batch cost (roles/intake.py): its sync handlers' time
against ``worker.fast_handler_ms`` and its payload against ``BATCH_BYTES``, capped by
``broker.prefetch``. The rule alone, then through the real worker loop with a stub broker
and a fake store (tests/unit/test_worker_loop.py's rig); the claim's ``payload_bytes`` from
PostgreSQL is tests/integration/test_batch_transitions.py's, the window of real worker
processes taking large inputs tests/integration/test_worker_batches.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from uuid import UUID

import pytest

from flowforge.domain.states import TaskState
from flowforge.roles.context import TaskContext
from flowforge.roles.intake import BATCH_BYTES, BatchCost, Intake
from tests.stubs import StubBroker
from tests.unit.test_worker_loop import PREFETCH, Rig, make_rig

FAST_S = 0.1


def window_after(*batches: tuple[float, int], held_up: bool = False, start: int = 4) -> int:
    """The window of an intake at ``start`` after full batches that cost (seconds, bytes)
    each."""
    intake = Intake(StubBroker(), prefetch=16, fast_s=FAST_S)
    intake.window = start
    for busy_s, payload in batches:
        intake.settle(held_up, BatchCost(busy_s, payload, intake.window))
    return intake.window


@pytest.mark.parametrize(
    ("busy_s", "payload", "window"),
    [
        (0.0, 0, 8),  # cheap: doubles
        (FAST_S, BATCH_BYTES, 8),  # at both budgets: still doubles
        (1.5 * FAST_S, 0, 4),  # over the time budget, not twice it: kept
        (0.0, int(1.5 * BATCH_BYTES), 4),  # over the payload budget, not twice it: kept
        (2 * FAST_S, 2 * BATCH_BYTES, 4),  # twice either, exactly: kept
        (2.5 * FAST_S, 0, 2),  # over twice the time budget: halved
        (0.0, 3 * BATCH_BYTES, 2),  # over twice the payload budget: halved
        (0.0, 2 * BATCH_BYTES + 1, 2),  # just over twice: halved
    ],
)
def test_the_window_doubles_keeps_or_halves_by_the_dearer_of_time_and_payload(
    busy_s: float, payload: int, window: int
) -> None:
    assert window_after((busy_s, payload)) == window


def test_the_window_never_passes_the_prefetch_nor_falls_below_one() -> None:
    assert window_after(*[(0.0, 0)] * 6) == 16
    assert window_after(*[(0.0, 10 * BATCH_BYTES)] * 6) == 1


@pytest.mark.parametrize(
    ("tasks", "payload", "window"),
    [
        (1, int(0.2 * BATCH_BYTES), 8),  # a sixteenth of the window: 3.2 budgets if full
        (1, int(0.1 * BATCH_BYTES), 16),  # 1.6 budgets if full: kept
        (1, int(0.05 * BATCH_BYTES), 32),  # 0.8 budgets if full: doubles
        (8, int(0.8 * BATCH_BYTES), 16),  # half full: 1.6 budgets if full
        (0, 0, 32),  # no task claimed (every delivery stale): nothing learnt, cheap
    ],
)
def test_a_batch_that_came_short_of_the_window_is_judged_as_if_it_had_filled_it(
    tasks: int, payload: int, window: int
) -> None:
    """A nearly empty queue hands the worker small batches: cheap as they are, they say
    nothing about a full window of the same tasks, which the next burst would fill."""
    intake = Intake(StubBroker(), prefetch=64, fast_s=FAST_S)
    intake.window = 16
    intake.settle(False, BatchCost(0.0, payload, tasks))
    assert intake.window == window


def test_a_slow_sync_handler_resets_the_window_to_one_whatever_the_batch_cost() -> None:
    assert window_after((0.0, 0), held_up=True, start=16) == 1


@pytest.fixture
def big_rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.worker.shutdown()


@pytest.mark.parametrize(
    ("each", "takes"),
    [
        # 0.4 of the budget each: 1 → 2 (0.4), 2 → 4 (0.8), then 4 stays (1.6)
        (int(0.4 * BATCH_BYTES), [1, 2, 4, 4, 4]),
        # 0.9 of the budget each: 1 → 2 (0.9), then 2 stays (1.8)
        (int(0.9 * BATCH_BYTES), [1, 2, 2, 2, 2, 2, 2, 2]),
        # over twice the budget each: the window stays at 1 (halved, not below it)
        (2 * BATCH_BYTES + 1, [1] * 15),
    ],
)
def test_a_worker_takes_smaller_batches_of_tasks_whose_claims_carry_large_payloads(
    big_rig: Rig, each: int, takes: list[int]
) -> None:
    tasks = big_rig.publish("fast", 15)
    for task_id in tasks:
        big_rig.store.tasks[task_id].payload_bytes = each
    big_rig.run()
    assert big_rig.broker.takes() == takes
    assert sorted(big_rig.ran) == sorted(tasks)  # each once, whatever the batches


def test_large_results_count_as_payload_too() -> None:
    """Results of 0.45 of the budget each (under max_result_bytes): 1 → 2 → 4, then 4 stays
    (1.8 budgets); counting the claims alone, the window would have reached the prefetch."""
    result = "x" * int(0.45 * BATCH_BYTES)
    made = make_rig(handlers={"big": lambda ctx: result})
    try:
        tasks = made.publish("big", 15)
        made.run()
    finally:
        made.worker.shutdown()
    assert made.broker.takes() == [1, 2, 4, 4, 4]
    assert {made.store.tasks[t].state for t in tasks} == {TaskState.SUCCEEDED}


def test_captured_output_counts_as_payload_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a handler wrote (ctx.log, stdout, stderr) is held with its outcome until the
    finish: each batch's payload counts it (about 60,000 characters a task of ctx.log here,
    a result of a few)."""
    costs: list[BatchCost] = []
    settle = Intake.settle

    def spy(self: Intake, held_up: bool, cost: BatchCost) -> None:
        costs.append(cost)
        settle(self, held_up, cost)

    monkeypatch.setattr(Intake, "settle", spy)
    made = make_rig(handlers={"loud": lambda ctx: ctx.log.info("x" * 60_000)})
    try:
        tasks = made.publish("loud", 7)
        made.run()
    finally:
        made.worker.shutdown()
    assert [c.tasks for c in costs] == [1, 2, 4]
    assert all(60_000 * c.tasks <= c.payload_bytes < 61_000 * c.tasks for c in costs), costs
    assert {made.store.tasks[t].state for t in tasks} == {TaskState.SUCCEEDED}


def test_batches_of_handlers_fast_alone_but_slow_together_stop_growing() -> None:
    """Each handler takes 0.4 of fast_handler_ms: a batch of four takes more than the
    budget, so the window never reaches the prefetch (8), as it did when only each handler's
    own time counted. (A loaded machine can only make the handlers slower, which keeps the
    window smaller still.)"""
    fast_ms = 250.0
    ran: list[UUID] = []

    def medium(ctx: TaskContext) -> None:
        time.sleep(0.4 * fast_ms / 1000)
        ran.append(ctx.task_run_id)

    made = make_rig(handlers={"medium": medium}, fast_ms=fast_ms)
    try:
        tasks = made.publish("medium", 14)
        made.run()
    finally:
        made.worker.shutdown()
    assert max(made.broker.takes()) <= 4 < PREFETCH
    assert sorted(ran) == sorted(tasks)
    assert {made.store.tasks[t].state for t in tasks} == {TaskState.SUCCEEDED}
