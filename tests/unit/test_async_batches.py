"""How a worker batches ``async def`` calls (docs/handlers.md): the window growing to
``worker.async_concurrency`` and a slow async call not setting it back, and a batch of async
calls rolling (filling the slots its calls free, acked at once) — through the worker's seams, as
tests/unit/test_async_handlers.py (whose rig and helpers these use).
"""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

import pytest

from flowforge.config import ProcessesConfig
from flowforge.domain.states import TaskState
from flowforge.roles import batch
from flowforge.roles.context import TaskContext
from tests.unit.test_async_handlers import Gauge, finish_of, rig_with, rigs
from tests.unit.test_worker_loop import PREFETCH, Rig

_ = rigs  # the fixture, shared with tests/unit/test_async_handlers.py


def test_the_window_grows_to_async_concurrency_above_the_prefetch(rigs: list[Rig]) -> None:
    """A 50 ms async call is no slow handler (it holds nothing up), so the window doubles
    past ``broker.prefetch`` (8 here) up to ``async_concurrency``."""
    gauge = Gauge()
    rig = rig_with(rigs, {"nap": gauge.nap}, fast_ms=20.0, async_concurrency=2 * PREFETCH)
    rig.publish("nap", 1 + 2 + 4 + 8 + 16 + 16)
    rig.run()
    assert rig.broker.takes()[:5] == [1, 2, 4, 8, 16]  # then it rolls (its top-ups)
    assert gauge.most == 2 * PREFETCH
    assert rig.finished.count == 1 + 2 + 4 + 8 + 16 + 16


@pytest.mark.parametrize("concurrency", [PREFETCH // 2, 3 * PREFETCH // 2])
def test_a_worker_with_async_handlers_only_takes_async_concurrency_at_once(
    rigs: list[Rig], concurrency: int
) -> None:
    """From the first batch, and never more than can run (broker.prefetch is 8 here)."""
    gauge = Gauge()
    rig = rig_with(rigs, {"fast": gauge.nap}, async_concurrency=concurrency)  # no sync one
    rig.publish("fast", 2 * concurrency + 1)
    rig.run()
    assert rig.broker.takes()[0] == concurrency
    assert gauge.most == concurrency
    assert rig.finished.count == 2 * concurrency + 1


def test_a_slow_async_batch_keeps_the_window_a_slow_sync_one_resets_it(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both take the slow path (stop consuming, ack); only the sync one held tasks up."""
    monkeypatch.setattr(batch, "ASYNC_SLOW_S", 0.05)

    async def slow_async(ctx: TaskContext) -> None:
        await asyncio.sleep(0.3)

    def slow_sync(ctx: TaskContext) -> None:
        time.sleep(0.3)

    handlers = {"slow_async": slow_async, "slow_sync": slow_sync}
    rig = rig_with(rigs, handlers, fast_ms=50.0, async_concurrency=PREFETCH)
    rig.store.on_release = rig.broker.publish  # the outbox row a release writes
    rig.publish("fast", 1 + 2)
    rig.publish("slow_async", 4)  # the window was 4: a batch of four slow async calls
    rig.publish("fast", 8)
    rig.publish("slow_sync")
    behind = rig.publish("fast", 2)  # handed back behind the slow sync call
    rig.run()
    assert rig.broker.takes() == [1, 2, 4, 8, 8, 1, 2]
    # the two slow batches each hand back; the take after the slow sync one hands back what
    # came with it (a worker held up by a slow sync handler consumes only while it takes)
    assert rig.trace("hand_back").count("hand_back") == 3
    assert rig.store.count("release_claims") == 1  # the slow async batch had nothing behind
    assert {rig.store.tasks[t].attempt for t in behind} == {1}
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}


def test_a_sync_only_worker_keeps_broker_prefetch_as_its_largest_batch(rigs: list[Rig]) -> None:
    rig = rig_with(rigs, {}, async_concurrency=4 * PREFETCH)
    rig.publish("fast", 1 + 2 + 4 + 8 + 8)
    rig.run()
    assert rig.broker.takes() == [1, 2, 4, 8, 8]


# ------------------------------------------------------------------ a batch of async calls rolls


def test_a_batch_of_async_calls_fills_the_slots_its_calls_free(rigs: list[Rig]) -> None:
    """Each freed slot takes a delivery at once, claimed and acked then: far fewer finish
    statements than batches of four, never more than four calls at once, each task once."""
    gauge = Gauge()
    rig = rig_with(rigs, {"fast": gauge.nap}, async_concurrency=4)
    tasks = rig.publish("fast", 40)
    rig.run()
    assert gauge.most == 4
    assert rig.finished.count == 40 and rig.ran == []
    assert {finish_of(rig, t).state for t in tasks} == {TaskState.SUCCEEDED}
    assert rig.store.count("finish_many") < 40 // 4
    assert rig.trace("take_above")  # the top-ups
    # every claim is acked before anything else is claimed: the window is never held
    claims_and_acks = rig.trace("claim_many", "ack")
    assert claims_and_acks == ["claim_many", "ack"] * (len(claims_and_acks) // 2)
    assert rig.broker.unacked == 0


def test_a_rolling_batch_takes_nothing_more_once_the_worker_stops(rigs: list[Rig]) -> None:
    rig: Rig

    async def stops(ctx: TaskContext) -> None:
        if len(calls) == 5:
            rig.stop.set()  # SIGTERM, as the role sees it
        calls.append(ctx.task_run_id)
        await asyncio.sleep(0.02)

    calls: list[UUID] = []
    rig = rig_with(rigs, {"fast": stops}, async_concurrency=2)
    tasks = rig.publish("fast", 30)
    rig.worker.initialize()
    rig.worker.loop(rig.stop, lambda: None)
    states = rig.store.states()
    assert TaskState.RUNNING not in states.values()  # every claim finished: no lease left
    assert [t for t in tasks if states[t] is TaskState.SUCCEEDED] == calls
    assert len(calls) <= 5 + 2  # what ran or was claimed when it stopped
    assert rig.worker._leases.held(tasks) == []


def test_a_rolling_batch_takes_no_more_than_recycling_leaves(rigs: list[Rig]) -> None:
    gauge = Gauge()
    rig = rig_with(
        rigs,
        {"fast": gauge.nap},
        async_concurrency=4,
        processes=ProcessesConfig(max_tasks_per_child=10),
    )
    rig.publish("fast", 30)
    rig.run()
    assert rig.worker.recycle and rig.finished.count == 10
    assert (
        sorted(s.value for s in rig.store.states().values()) == ["READY"] * 20 + ["SUCCEEDED"] * 10
    )


def test_a_sync_claim_ends_the_roll_and_runs_on_the_handler_thread(rigs: list[Rig]) -> None:
    """A worker with both kinds rolls at its full window (async_concurrency 2 here)."""
    gauge = Gauge()
    rig = rig_with(rigs, {"nap": gauge.nap}, async_concurrency=2)
    naps = rig.publish("nap", 1 + 2)  # the second batch, of two, is at the full window
    syncs = rig.publish("fast", 2)  # taken by its top-ups
    more = rig.publish("nap", 6)
    rig.run()
    assert rig.trace("take_above")
    assert sorted(rig.ran) == sorted(syncs)
    assert {finish_of(rig, t).state for t in naps + syncs + more} == {TaskState.SUCCEEDED}
    assert rig.finished.count == 11 and gauge.most == 2
