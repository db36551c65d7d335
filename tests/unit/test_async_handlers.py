"""``async def`` handlers through the worker's seams (SPEC 7.5, docs/handlers.md).

The real :class:`~flowforge.roles.worker.Worker` loop, its handler thread and its event loop
thread, over :class:`tests.stubs.StubBroker` and :class:`tests.stubs.FakeStore` (the rig of
tests/unit/test_worker_loop.py): the concurrency bound, a batch running at once, the window
growing to ``async_concurrency``, cancellation and timeouts raising
:class:`asyncio.CancelledError` inside the handler, failures, and batches that mix sync and
async handlers. The same with real RabbitMQ, PostgreSQL and processes:
tests/integration/test_async_handlers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from flowforge.config import load_config
from flowforge.domain.model import Claim, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import ConfigError, PermanentError
from flowforge.roles import batch
from flowforge.roles.context import TaskContext
from flowforge.roles.hooks import Hook
from tests.unit.test_worker_loop import BLOCK_S, Rig, make_rig

#: An async handler's await, long enough that a batch's calls overlap if they run at once.
NAP_S = 0.05


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.worker.shutdown()


def rig_with(rigs: list[Rig], handlers: dict[str, Any], **options: Any) -> Rig:
    made = make_rig(handlers, **options)
    rigs.append(made)
    return made


def finish_of(rig: Rig, task: UUID) -> Finish:
    finish = rig.store.tasks[task].finish
    assert finish is not None, "the task was never finished"
    return finish


def result_of(rig: Rig, task: UUID) -> Any:
    result = finish_of(rig, task).result
    return None if result is None else json.loads(result)


class Gauge:
    """How many async calls run at once, and the most seen."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    async def nap(self, ctx: TaskContext) -> dict[str, str]:
        self.now += 1  # one event loop thread: no lock needed
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(NAP_S)
        finally:
            self.now -= 1
        return {"slept": str(ctx.task_run_id)}


class Sleeper:
    """An async handler that awaits BLOCK_S (after ``first(ctx)``, if given) and notes the
    CancelledError that ends it early in ``seen``."""

    def __init__(self, first: Callable[[TaskContext], None] = lambda ctx: None) -> None:
        self.first = first
        self.seen: list[str] = []

    async def __call__(self, ctx: TaskContext) -> None:
        self.first(ctx)
        try:
            await asyncio.sleep(BLOCK_S)
        except asyncio.CancelledError:
            self.seen.append("cancelled")
            raise
        self.seen.append("slept")  # pragma: no cover - only if nothing cancelled it


def test_no_more_than_async_concurrency_calls_run_at_once(rigs: list[Rig]) -> None:
    gauge = Gauge()
    rig = rig_with(rigs, {"nap": gauge.nap}, async_concurrency=3)
    tasks = rig.publish("nap", 20)
    rig.run()
    assert gauge.most == 3
    assert {finish_of(rig, t).state for t in tasks} == {TaskState.SUCCEEDED}
    assert [result_of(rig, t) for t in tasks] == [{"slept": str(t)} for t in tasks]
    assert rig.finished.count == 20  # each finished once
    assert not rig.worker.recycle


def test_a_batch_of_async_handlers_runs_at_once(rigs: list[Rig]) -> None:
    """Each call waits until all of its batch have started: only concurrent calls can end."""
    width = 4
    started: list[UUID] = []
    everyone = asyncio.Event()

    async def meet(ctx: TaskContext) -> int:
        started.append(ctx.task_run_id)
        if len(started) == 1 + 2 + width:  # the batches of the window before: 1, 2
            everyone.set()
        if len(started) > 1 + 2:
            await asyncio.wait_for(everyone.wait(), BLOCK_S)
        return len(started)

    rig = rig_with(rigs, {"meet": meet}, fast_ms=2000.0)
    tasks = rig.publish("meet", 1 + 2 + width)
    rig.run()
    assert rig.broker.takes() == [1, 2, 4]
    assert {finish_of(rig, t).state for t in tasks} == {TaskState.SUCCEEDED}
    # the last batch's calls all returned after the last of them had started
    assert [result_of(rig, t) for t in tasks[3:]] == [7] * width


def test_a_cancelled_run_raises_cancelled_error_inside_the_handler(rigs: list[Rig]) -> None:
    def cancel(ctx: TaskContext) -> None:
        rig.store.tasks[ctx.task_run_id].cancel_requested = True  # an operator's cancel

    polite = Sleeper(cancel)
    seen = polite.seen
    rig = rig_with(rigs, {"polite": polite}, heartbeat_s=0.1)
    [task] = rig.publish("polite")
    began = time.monotonic()
    rig.run()
    assert seen == ["cancelled"]
    assert time.monotonic() - began < BLOCK_S / 2
    assert finish_of(rig, task).state is TaskState.CANCELLED
    assert rig.telemetry.tasks_cancelled.value() == 1
    assert not rig.worker.recycle  # the loop stopped the call: nothing to replace


def test_a_handler_that_catches_its_cancellation_and_returns_ends_cancelled(
    rigs: list[Rig],
) -> None:
    async def tidy(ctx: TaskContext) -> dict[str, bool]:
        rig.store.tasks[ctx.task_run_id].cancel_requested = True
        try:
            await asyncio.sleep(BLOCK_S)
        except asyncio.CancelledError:
            return {"tidied": True}
        return {"tidied": False}  # pragma: no cover

    rig = rig_with(rigs, {"tidy": tidy}, heartbeat_s=0.1)
    [task] = rig.publish("tidy")
    rig.run()
    assert finish_of(rig, task).state is TaskState.CANCELLED
    assert result_of(rig, task) == {"tidied": True}


def test_a_lost_lease_cancels_the_call_and_its_finish_is_stale(rigs: list[Rig]) -> None:
    def reap(ctx: TaskContext) -> None:
        rig.store.tasks[ctx.task_run_id].token += 1  # the reaper took the task back

    reaped = Sleeper(reap)
    seen = reaped.seen
    rig = rig_with(rigs, {"reaped": reaped}, heartbeat_s=0.1)
    [task] = rig.publish("reaped")
    rig.run()
    assert seen == ["cancelled"]
    assert rig.store.tasks[task].state is TaskState.RUNNING  # the finish changed nothing
    assert rig.telemetry.stale_completions.value() == 1


def test_an_async_handler_past_its_timeout_is_cancelled_and_fails_with_timeout(
    rigs: list[Rig],
) -> None:
    stuck = Sleeper()
    seen = stuck.seen
    rig = rig_with(rigs, {"stuck": stuck}, fast_ms=50.0)
    [task] = rig.publish("stuck")
    rig.store.tasks[task].timeout_s = 0.2
    began = time.monotonic()
    rig.run()
    assert time.monotonic() - began < BLOCK_S / 2
    assert seen == ["cancelled"]
    finish = finish_of(rig, task)
    assert (finish.state, finish.reason) == (TaskState.FAILED, FailureReason.TIMEOUT)
    assert finish.error == "the handler ran longer than its timeout of 0.2s"  # the sync text
    assert rig.telemetry.tasks_failed.labels(reason="timeout").value() == 1
    assert not rig.worker.recycle  # unlike a sync handler's: the call was stopped


def test_a_timeout_of_one_call_does_not_wait_for_the_call_ahead_of_it(rigs: list[Rig]) -> None:
    """The loop applies each call's timeout itself: a timeout is not late because the main
    thread was waiting on another task of the batch."""
    ended: dict[str, float] = {}
    began = time.monotonic()

    async def long(ctx: TaskContext) -> None:
        await asyncio.sleep(1.5)
        ended["long"] = time.monotonic() - began

    async def short(ctx: TaskContext) -> None:
        try:
            await asyncio.sleep(BLOCK_S)
        finally:
            ended["short"] = time.monotonic() - began

    rig = rig_with(rigs, {"long": long, "short": short})
    [first] = rig.publish("fast")
    ahead = rig.publish("long")
    [timed] = rig.publish("short")
    rig.store.tasks[timed].timeout_s = 0.2
    rig.run()
    assert ended["short"] < ended["long"]
    assert finish_of(rig, timed).reason is FailureReason.TIMEOUT
    assert finish_of(rig, ahead[0]).state is TaskState.SUCCEEDED
    assert finish_of(rig, first).state is TaskState.SUCCEEDED


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        (ValueError("bad row 7"), FailureReason.HANDLER_ERROR),
        (PermanentError("never again"), FailureReason.PERMANENT_ERROR),
    ],
)
def test_an_exception_fails_the_task_with_its_text_and_traceback(
    rigs: list[Rig], raised: Exception, reason: FailureReason
) -> None:
    async def broken_handler(ctx: TaskContext) -> None:
        await asyncio.sleep(0)
        raise raised

    rig = rig_with(rigs, {"broken": broken_handler})
    [task] = rig.publish("broken")
    rig.run()
    finish = finish_of(rig, task)
    assert (finish.state, finish.reason) == (TaskState.FAILED, reason)
    assert finish.error == f"{type(raised).__name__}: {raised}"
    assert finish.traceback is not None and "broken_handler" in finish.traceback


def test_an_unstorable_result_fails_as_a_sync_one_does(rigs: list[Rig]) -> None:
    async def odd(ctx: TaskContext) -> object:
        return {"when": object()}

    rig = rig_with(rigs, {"odd": odd})
    [task] = rig.publish("odd")
    rig.run()
    assert finish_of(rig, task).reason is FailureReason.UNSERIALIZABLE_RESULT


def test_a_blocking_sync_handler_does_not_stall_the_async_ones_of_its_batch(
    rigs: list[Rig],
) -> None:
    """The sync call blocks until an async call of the same batch has run: were the loop
    stalled by it (or run on its thread), neither could end."""
    unblocked = threading.Event()

    def blocker(ctx: TaskContext) -> str:
        if not unblocked.wait(BLOCK_S):
            raise AssertionError("the async handler never ran while the sync one blocked")
        return "sync"

    async def opener(ctx: TaskContext) -> str:
        await asyncio.sleep(0.01)
        unblocked.set()
        return "async"

    rig = rig_with(rigs, {"blocker": blocker, "opener": opener})
    warmup = rig.publish("fast", 1)
    mixed = [*rig.publish("blocker"), *rig.publish("opener"), *rig.publish("fast")]
    rig.run()
    assert [size for name, size in rig.journal if name == "claim_many"] == [1, 2, 1]
    assert [finish_of(rig, t).state for t in warmup + mixed] == [TaskState.SUCCEEDED] * 4
    assert [result_of(rig, t) for t in mixed[:2]] == ["sync", "async"]


def test_a_mixed_batch_finishes_every_task_once_in_one_statement(rigs: list[Rig]) -> None:
    gauge = Gauge()
    rig = rig_with(rigs, {"nap": gauge.nap})
    kinds = ["fast", "nap", "fast", "nap", "nap", "fast", "nap"]
    tasks = [task for kind in kinds for task in rig.publish(kind)]
    rig.run()
    assert rig.broker.takes() == [1, 2, 4]
    assert [size for name, size in rig.journal if name == "finish_many"] == [1, 2, 4]
    assert {finish_of(rig, t).state for t in tasks} == {TaskState.SUCCEEDED}
    assert sorted(rig.ran) == sorted(t for t, k in zip(tasks, kinds, strict=True) if k == "fast")


def test_a_sync_handler_that_returns_a_coroutine_fails_with_a_clear_error(
    rigs: list[Rig],
) -> None:
    async def body(ctx: TaskContext) -> int:
        return 1

    def wrapper(ctx: TaskContext) -> Any:  # not async def: its coroutine is never awaited
        return body(ctx)

    rig = rig_with(rigs, {"wrapped": wrapper})
    [task] = rig.publish("wrapped")
    rig.run()
    finish = finish_of(rig, task)
    assert (finish.state, finish.reason) == (TaskState.FAILED, FailureReason.HANDLER_ERROR)
    assert finish.error is not None and "async def" in finish.error


def test_an_async_callable_object_runs_on_the_loop(rigs: list[Rig]) -> None:
    class Caller:
        async def __call__(self, ctx: TaskContext) -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

    rig = rig_with(rigs, {"obj": Caller()})
    [task] = rig.publish("obj")
    rig.run()
    assert result_of(rig, task) == "async-handlers"


def test_calls_that_ended_are_committed_while_a_slow_async_call_runs(rigs: list[Rig]) -> None:
    """The slow call returns only once the store shows the others SUCCEEDED: they must have
    been committed while it ran, not held until it ended."""

    async def quick(ctx: TaskContext) -> None:
        await asyncio.sleep(0.01)

    async def patient(ctx: TaskContext) -> str:
        deadline = time.monotonic() + BLOCK_S
        while time.monotonic() < deadline:
            states = [rig.store.tasks[t].state for t in behind]
            if states == [TaskState.SUCCEEDED] * len(behind):
                return "saw them committed"
            await asyncio.sleep(0.02)
        raise AssertionError("the calls behind were not committed while this one ran")

    rig = rig_with(rigs, {"quick": quick, "patient": patient})
    rig.publish("quick", 1 + 2)
    [slow] = rig.publish("patient")
    behind = rig.publish("quick", 3)
    rig.run()
    assert result_of(rig, slow) == "saw them committed"
    assert rig.store.count("release_claims") == 0  # nothing waited behind it to hand back
    assert rig.finished.count == 7


class GiveUp(Hook):
    """Gives every handler up after 0.1 s, as a time limit would."""

    def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
        if elapsed_s < 0.1:
            return 0.1 - elapsed_s
        return Finish(TaskState.FAILED, reason=FailureReason.TIMEOUT, error="given up")


def test_a_hook_that_gives_an_async_call_up_cancels_it_without_recycling(
    rigs: list[Rig],
) -> None:
    long = Sleeper()
    rig = rig_with(rigs, {"long": long}, fast_ms=20.0, hooks=[GiveUp()])
    [task] = rig.publish("long")
    rig.run()
    wait_until_seen(long.seen)
    assert finish_of(rig, task).error == "given up"
    assert not rig.worker.recycle


def test_an_async_call_that_ignores_its_cancellation_gets_the_worker_replaced(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "GIVE_UP_GRACE_S", 0.2)
    release = threading.Event()

    async def stubborn(ctx: TaskContext) -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # ignored: the call goes on
                await asyncio.sleep(0.02)

    rig = rig_with(rigs, {"stubborn": stubborn}, fast_ms=20.0)
    [task] = rig.publish("stubborn")
    rig.store.tasks[task].timeout_s = 0.1  # the loop's timeout is ignored as well
    try:
        rig.run()
    finally:
        release.set()
    finish = finish_of(rig, task)
    assert (finish.state, finish.reason) == (TaskState.FAILED, FailureReason.TIMEOUT)
    assert rig.worker.recycle


def wait_until_seen(seen: list[str]) -> None:
    deadline = time.monotonic() + BLOCK_S
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["cancelled"]


def test_context_variables_are_per_call(rigs: list[Rig]) -> None:
    mine: contextvars.ContextVar[UUID] = contextvars.ContextVar("mine")
    width = 4
    arrived: list[UUID] = []
    together = asyncio.Event()

    async def keep(ctx: TaskContext) -> bool:
        mine.set(ctx.task_run_id)
        arrived.append(ctx.task_run_id)
        if len(arrived) == 1 + 2 + width:
            together.set()
        if len(arrived) > 1 + 2:  # every call of the batch has set its own value by now
            await asyncio.wait_for(together.wait(), BLOCK_S)
        return mine.get() == ctx.task_run_id

    rig = rig_with(rigs, {"keep": keep})
    tasks = rig.publish("keep", 1 + 2 + width)
    rig.run()
    assert [result_of(rig, t) for t in tasks] == [True] * len(tasks)


def test_a_call_does_not_inherit_the_context_variables_of_the_call_before_it(
    rigs: list[Rig],
) -> None:
    """One slot: the second call starts as the first ends (in its task's finally)."""
    mine: contextvars.ContextVar[str] = contextvars.ContextVar("mine", default="unset")

    async def look_then_set(ctx: TaskContext) -> str:
        before = mine.get()
        mine.set(str(ctx.task_run_id))
        await asyncio.sleep(0)
        return before

    # with a sync handler too, the window grows past the one slot: calls wait for it
    rig = rig_with(rigs, {"look": look_then_set}, async_concurrency=1)
    tasks = rig.publish("look", 1 + 2 + 4)
    rig.run()
    assert [result_of(rig, t) for t in tasks] == ["unset"] * 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "async_concurrency must be between 1 and 65535"),
        ("-3", "async_concurrency must be between 1 and 65535"),
        ("65536", "async_concurrency must be between 1 and 65535"),
        ("many", "worker.async_concurrency: expected an integer"),
        ("true", "worker.async_concurrency: expected an integer"),
        ("2.5", "worker.async_concurrency: expected an integer"),
    ],
)
def test_a_bad_async_concurrency_is_refused_with_its_path(
    tmp_path: Path, value: str, expected: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"worker:\n  async_concurrency: {value}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    assert expected in str(refused.value)


def test_async_concurrency_defaults_to_16_and_is_read_from_the_file(tmp_path: Path) -> None:
    assert load_config(env={}).worker.async_concurrency == 16
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  async_concurrency: 64\n")
    assert load_config(path, env={}).worker.async_concurrency == 64
