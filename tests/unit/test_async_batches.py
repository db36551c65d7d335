"""How a worker batches ``async def`` calls (docs/handlers.md): the window growing to
``worker.async_concurrency`` and a slow async call not setting it back, and a batch of async
calls rolling (filling the slots its calls free, acked at once) — through the worker's seams, as
tests/unit/test_async_handlers.py (whose rig and helpers these use).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from uuid import UUID, uuid4

import pytest

from flowforge.config import ProcessesConfig
from flowforge.domain.states import TaskState
from flowforge.roles import batch
from flowforge.roles.context import TaskContext
from tests.helpers import wait_for
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
    # thresholds well above what a no-op batch takes on a loaded machine (200 ms was not, once,
    # with the fast layer on both cores), the slow calls well above them: a fast batch seen as
    # slow would hand back once more
    monkeypatch.setattr(batch, "ASYNC_SLOW_S", 0.6)

    async def slow_async(ctx: TaskContext) -> None:
        await asyncio.sleep(1.2)

    def slow_sync(ctx: TaskContext) -> None:
        time.sleep(1.2)

    handlers = {"slow_async": slow_async, "slow_sync": slow_sync}
    rig = rig_with(rigs, handlers, fast_ms=600.0, async_concurrency=PREFETCH)
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


def test_a_rolling_batch_commits_its_outcomes_as_it_goes(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty quick calls roll through one batch: their outcomes are committed by
    ``FLUSH_AFTER`` (eight here), not all at its end, each task once (an outcome holds its
    claim, context and output until committed)."""
    monkeypatch.setattr(batch, "FLUSH_AFTER", 8)
    monkeypatch.setattr(batch, "ROLL_S", 30.0)  # the roll outlasts the forty calls
    sizes: list[int] = []
    flush = batch.Batch._flush

    def measured(self: batch.Batch, then: Any) -> None:
        sizes.append(len(self._outcomes))
        flush(self, then)

    monkeypatch.setattr(batch.Batch, "_flush", measured)
    gauge = Gauge()
    rig = rig_with(rigs, {"fast": gauge.nap}, async_concurrency=4)
    tasks = rig.publish("fast", 40)
    rig.run()
    assert rig.finished.count == 40
    assert {finish_of(rig, t).state for t in tasks} == {TaskState.SUCCEEDED}
    committed = [n for n in sizes if n]
    assert sum(committed) == 40
    assert max(committed) <= 8 and len(committed) >= 40 // 8, committed
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


# ------------------------------------------------------------- a slow batch of async calls rolls on


@pytest.fixture
def quick_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call is slow past 50 ms, a batch none of whose calls is slow rolls for 20 ms, and a
    slow one takes its turns every 20 ms (a second each in a worker)."""
    monkeypatch.setattr(batch, "ASYNC_SLOW_S", 0.05)
    monkeypatch.setattr(batch, "ROLL_S", 0.02)
    monkeypatch.setattr(batch, "PUMP_INTERVAL_S", 0.02)


def long_call(rig: list[Rig], arrivals: list[UUID], count: int, ended: dict[str, float]) -> Any:
    """An async handler that, once its batch is slow and past its first roll, publishes
    ``count`` tasks of ``fast`` (into ``arrivals``), then runs on for 0.5 s."""

    async def long(ctx: TaskContext) -> None:
        await asyncio.sleep(0.1)
        arrivals.extend(rig[0].publish("fast", count))
        await asyncio.sleep(0.5)
        ended["long"] = time.monotonic()

    return long


@pytest.mark.usefixtures("quick_turns")
def test_a_slow_rolling_batch_fills_its_free_slots_with_work_that_comes_in_later(
    rigs: list[Rig],
) -> None:
    """Work that arrives after the batch's first roll, while a long call runs, runs in the
    slots beside it at once, not after it (the slots would otherwise idle for the long
    call's whole length, however much work waits)."""
    ended: dict[str, float] = {}
    arrivals: list[UUID] = []
    holder: list[Rig] = []

    async def quick(ctx: TaskContext) -> None:
        await asyncio.sleep(0.01)
        ended[str(ctx.task_run_id)] = time.monotonic()

    long = long_call(holder, arrivals, 6, ended)
    rig = rig_with(rigs, {"fast": quick, "long": long}, fast_ms=20.0, async_concurrency=4)
    holder.append(rig)
    rig.publish("long")
    rig.run()
    assert len(arrivals) == 6
    assert all(ended[str(t)] < ended["long"] for t in arrivals)
    assert rig.finished.count == 7
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    assert rig.broker.unacked == 0


@pytest.mark.usefixtures("quick_turns")
def test_a_slow_rolling_batch_with_every_slot_busy_holds_no_delivery(rigs: list[Rig]) -> None:
    """With every slot running a long call the batch stops consuming (what came in is
    requeued for any worker), and consumes again once a slot is free: what arrived in the
    meantime waited in the queue, not here, and each task runs once."""
    ended: dict[str, float] = {}
    arrivals: list[UUID] = []
    holder: list[Rig] = []
    consuming: list[bool] = []
    long = long_call(holder, arrivals, 3, ended)

    async def quick(ctx: TaskContext) -> None:
        ended[str(ctx.task_run_id)] = time.monotonic()

    async def watched(ctx: TaskContext) -> None:
        task = asyncio.ensure_future(long(ctx))
        while not arrivals:
            await asyncio.sleep(0.005)
        consuming.append(holder[0].broker._consuming)
        await task

    handlers = {"fast": quick, "long": watched}
    rig = rig_with(rigs, handlers, fast_ms=20.0, async_concurrency=1)
    holder.append(rig)
    rig.publish("long")
    rig.run()
    assert consuming == [False]  # the slot was busy: nothing was being pushed here
    events = [name for name, _ in rig.journal if name in ("hand_back", "resume")]
    assert events[:2] == ["hand_back", "resume"]  # off while busy, on once the slot was free
    assert all(ended[str(t)] > ended["long"] for t in arrivals)
    assert rig.finished.count == 4 and set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    assert {rig.store.tasks[t].attempt for t in arrivals} == {1}


@pytest.mark.usefixtures("quick_turns")
def test_a_batch_rolling_behind_a_long_call_forgets_the_tasks_it_is_done_with(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sixty quick tasks roll through three slots behind one long call: each runs and is
    finished once, and the batch holds only its running calls and the few it waited for
    last (their inputs, results and output would otherwise pile up)."""
    sizes: list[int] = []
    harvest = batch.Batch._harvest

    def measured(self: batch.Batch, behind: Any) -> None:
        harvest(self, behind)
        sizes.append(len(self._tasks))

    monkeypatch.setattr(batch.Batch, "_harvest", measured)
    monkeypatch.setattr(batch, "FORGET_AFTER", 4)  # the tasks waited for: forgotten by fours
    ended: dict[str, float] = {}
    arrivals: list[UUID] = []
    holder: list[Rig] = []
    gauge = Gauge()
    rig = rig_with(
        rigs,
        {"fast": gauge.nap, "long": long_call(holder, arrivals, 60, ended)},
        fast_ms=20.0,
        async_concurrency=4,
    )
    holder.append(rig)
    rig.publish("long")
    rig.run()
    assert rig.finished.count == 61
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    # at most the four waited for last (not forgotten yet) and the four slots' calls: never
    # the sixty it ran (with one slot for the long call, the others roll through three)
    assert sizes and max(sizes) <= 4 + 4
    assert gauge.most <= 4


def test_a_worker_over_its_memory_limit_asks_to_recycle_at_its_next_commit() -> None:
    """Not only after a batch: one rolling on (async calls behind a long one) commits as it
    goes, and takes nothing more once the worker asked to go (Worker._take_more)."""
    from flowforge.roles.concerns import Recycling
    from flowforge.roles.hooks import Recycle

    within, over = Recycle(), Recycle()
    Recycling(ProcessesConfig(max_memory_mb_per_child=1 << 20), within, lambda: 0.0).after_finish(
        [], frozenset()
    )
    Recycling(ProcessesConfig(max_memory_mb_per_child=1), over, lambda: 0.0).after_finish(
        [], frozenset()
    )
    assert over.asked and not within.asked


@pytest.mark.usefixtures("quick_turns")
def test_a_long_batch_keeps_the_worker_s_registration_fresh(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowforge.roles import presence

    monkeypatch.setattr(presence, "TOUCH_INTERVAL_S", 0.05)
    seen: list[int] = []
    holder: list[Rig] = []

    async def long(ctx: TaskContext) -> None:
        seen.append(holder[0].store.count("register_process"))
        await asyncio.sleep(0.4)
        seen.append(holder[0].store.count("register_process"))

    rig = rig_with(rigs, {"fast": long}, fast_ms=20.0, async_concurrency=2, heartbeat_s=0.05)
    holder.append(rig)
    rig.publish("fast")
    rig.run()
    assert seen[1] > seen[0]  # refreshed while the call ran (after its lease renewals)


def test_a_hand_back_takes_only_the_jobs_no_free_slot_awaits() -> None:
    """A job submitted into a free slot starts in a moment: a hand-back leaves it (it would
    only go elsewhere to start later); one waiting for a slot is taken back."""
    from flowforge.roles.asyncrun import AsyncRunner
    from flowforge.roles.execution import Job

    runner = AsyncRunner(2)
    gate = threading.Event()

    async def held(ctx: Any) -> None:
        await asyncio.to_thread(gate.wait, 5.0)

    def job() -> Job:
        return Job(held, TaskContext({}, {}, 1, uuid4(), uuid4(), "t"), None)

    first = job()
    runner.submit([first])
    wait_for(lambda: first.started is not None, what="the first call running")
    promised, beyond = job(), job()
    with runner._lock:  # as if the loop had not yet come to them: both wait
        runner._waiting.extend([promised, beyond])
    assert runner.withdraw() == [beyond]
    gate.set()
    wait_for(lambda: first.done.is_set() and promised.done.is_set(), what="both calls done")
    assert beyond.started is None
