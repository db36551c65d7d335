"""The worker's batch logic through its seams: a stub broker and a fake store, no services.

Each test runs the real :class:`~flowforge.roles.worker.Worker` loop (its handler thread too)
against :class:`tests.stubs.StubBroker` and :class:`tests.stubs.FakeStore`, whose shared
journal shows every take, claim, ack and finish in order. The same behaviour through real
RabbitMQ and PostgreSQL is proven in tests/integration/test_worker_batches.py and
test_roles_delivery.py; these run in milliseconds.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from uuid import UUID

import pytest

from flowforge.config import BrokerConfig, Config, ProcessesConfig, WorkerConfig, load_config
from flowforge.domain.model import Claim, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError, DatabaseUnavailableError
from flowforge.roles.context import TaskContext
from flowforge.roles.hooks import Hook, Hooks
from flowforge.roles.worker import Worker
from flowforge.telemetry import Telemetry
from tests.helpers import wait_for
from tests.stubs import FakeStore, NullPool, Outcomes, StubBroker

PREFETCH = 8
#: Far above what a trivial handler takes, so a loaded machine cannot make one slow.
FAST_MS = 2000.0
#: A handler blocked on a test's event gives up after this (seconds): a bound, not a wait.
BLOCK_S = 10.0

Handler = Callable[[TaskContext], Any]


@dataclasses.dataclass
class Rig:
    worker: Worker
    broker: StubBroker
    store: FakeStore
    journal: list[tuple[str, Any]]
    ran: list[UUID]
    stop: threading.Event
    telemetry: Telemetry
    finished: Outcomes  # the outcomes the worker's finishes took

    def publish(self, handler: str, count: int = 1) -> list[UUID]:
        ids = self.store.add(handler, count)
        for task_id in ids:
            self.broker.publish(task_id, 1)
        return ids

    def run(self) -> None:
        """Run the loop until the broker has nothing left to deliver (or it recycles)."""
        self.stop.clear()
        self.worker.initialize()
        self.worker.loop(self.stop, lambda: None)

    def trace(self, *names: str) -> list[str]:
        """The journal's names among ``names``, takes that delivered nothing left out."""
        return [
            name
            for name, data in self.journal
            if name in names and not (name == "take" and data[1] == 0)
        ]


def make_rig(
    handlers: dict[str, Handler] | None = None,
    fast_ms: float = FAST_MS,
    processes: ProcessesConfig | None = None,
    heartbeat_s: float = 10.0,
    async_concurrency: int = 16,
    hooks: Sequence[Hook] = (),
) -> Rig:
    base = load_config(env={})
    config: Config = dataclasses.replace(
        base,
        broker=BrokerConfig(prefetch=PREFETCH),
        worker=WorkerConfig(
            fast_handler_ms=fast_ms,
            heartbeat_s=heartbeat_s,
            listen_for_cancel=False,
            async_concurrency=async_concurrency,
        ),
        processes=processes or base.processes,
    )
    journal: list[tuple[str, Any]] = []
    stop = threading.Event()
    ran: list[UUID] = []

    def fast(ctx: TaskContext) -> Any:
        ran.append(ctx.task_run_id)
        return {"ok": True}

    store = FakeStore(journal)
    broker = StubBroker(on_idle=stop.set, journal=journal)
    telemetry = Telemetry()
    finished = Outcomes()
    worker = Worker(
        config,
        telemetry,
        rand=lambda: 0.0,
        handlers={"fast": fast, **(handlers or {})},
        broker=broker,
        store=store,
        db=NullPool(),
        hooks=[finished, *hooks],
    )
    return Rig(worker, broker, store, journal, ran, stop, telemetry, finished)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.worker.shutdown()


def test_the_window_doubles_from_one_to_the_prefetch_while_handlers_are_fast(rig: Rig) -> None:
    tasks = rig.publish("fast", 1 + 2 + 4 + 8 + 8 + 3)
    rig.run()
    assert rig.broker.takes() == [1, 2, 4, 8, 8, 8]
    assert sorted(rig.ran) == sorted(tasks)
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    assert rig.finished.count == len(tasks)
    assert rig.telemetry.tasks_succeeded.value() == len(tasks)


def test_a_batch_is_one_claim_one_multiple_ack_after_it_and_one_finish(rig: Rig) -> None:
    rig.publish("fast", 1 + 2 + 4)
    rig.run()
    assert (
        rig.trace("take", "claim_many", "ack", "finish_many")
        == [
            "take",
            "claim_many",
            "ack",
            "finish_many",
        ]
        * 3
    )
    assert rig.broker.acks() == [1, 3, 7]  # each the batch's last tag, acked with multiple
    assert [size for name, size in rig.journal if name == "claim_many"] == [1, 2, 4]
    assert [size for name, size in rig.journal if name == "finish_many"] == [1, 2, 4]
    assert rig.broker.unacked == 0


def test_a_slow_handler_hands_back_the_claims_behind_it_and_the_window_falls_to_one() -> None:
    made = make_rig(fast_ms=200.0)
    slow_ran: list[UUID] = []

    def slow(ctx: TaskContext) -> None:
        slow_ran.append(ctx.task_run_id)
        made.store.released.wait(BLOCK_S)  # slow until the worker has handed back

    made.worker._handlers = {**(made.worker._handlers or {}), "slow": slow}
    made.store.on_release = made.broker.publish  # the outbox row a release writes
    first = made.publish("fast", 1 + 2)
    held = made.publish("slow")
    behind = made.publish("fast", 3)
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.broker.takes() == [1, 2, 4, 1, 2]  # back to 1 after the slow batch
    assert made.store.count("release_claims") == 1
    assert ("release_claims", 3) in made.journal
    # the batch was acked (and its consumer cancelled first) before anything was handed back
    trace = made.trace("hand_back", "ack", "release_claims")
    at = trace.index("release_claims")
    assert trace[at - 2 : at] == ["hand_back", "ack"]
    assert slow_ran == held
    assert sorted(made.ran) == sorted(first + behind)  # each exactly once
    assert set(made.store.states().values()) == {TaskState.SUCCEEDED}
    assert {made.store.tasks[t].attempt for t in behind} == {1}  # the release un-counted it


def test_a_claim_that_fails_for_an_outage_is_not_acked_and_runs_after_the_reconnect(
    rig: Rig,
) -> None:
    [task] = rig.publish("fast")
    rig.store.outages["claim_many"] = 1
    with pytest.raises(DatabaseUnavailableError):
        rig.run()
    assert rig.broker.acks() == [] and rig.broker.unacked == 1 and rig.ran == []
    rig.worker.reset()  # what run_role does: the broker requeues the unacked delivery
    rig.run()
    assert rig.ran == [task]
    assert rig.broker.acks() == [2] and rig.broker.unacked == 0


def test_a_redelivered_message_for_a_finished_task_is_acked_without_running(rig: Rig) -> None:
    [done] = rig.store.add("fast", state=TaskState.SUCCEEDED)
    rig.broker.publish(done, 1)
    rig.run()
    assert rig.ran == []
    assert rig.broker.acks() == [1]
    assert rig.store.count("finish_many") == 0
    assert rig.store.tasks[done].state is TaskState.SUCCEEDED


def test_an_undecodable_message_is_dropped_and_acked(rig: Rig) -> None:
    rig.broker.publish_raw(b"not a dispatch")
    [task] = rig.publish("fast")
    rig.run()
    assert rig.ran == [task] and rig.broker.unacked == 0


def test_a_finish_postgresql_refuses_is_finished_task_by_task(rig: Rig) -> None:
    def bad(ctx: TaskContext) -> str:
        rig.ran.append(ctx.task_run_id)
        return "bad"

    rig.worker._handlers = {**(rig.worker._handlers or {}), "bad": bad}
    rig.store.refuse = lambda finish: finish.result == '"bad"'
    good = rig.publish("fast", 1 + 2 + 2)
    [culprit] = rig.publish("bad")
    rest = rig.publish("fast")
    rig.run()
    assert rig.broker.takes() == [1, 2, 4]
    # the last batch: its statement, then one per task, then the culprit as a failure
    assert [size for name, size in rig.journal if name == "finish_many"][2:] == [4, 1, 1, 1, 1, 1]
    states = rig.store.states()
    assert states.pop(culprit) is TaskState.FAILED
    assert set(states.values()) == {TaskState.SUCCEEDED} and set(states) == set(good + rest)
    finish = rig.store.tasks[culprit].finish
    assert finish is not None and finish.reason is FailureReason.UNSERIALIZABLE_RESULT
    assert rig.finished.count == 7 and not rig.worker.recycle


def test_a_finish_retried_through_an_outage_commits_once(rig: Rig) -> None:
    tasks = rig.publish("fast", 3)
    rig.store.outages["finish_many"] = 2
    rig.run()
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    assert sorted(rig.ran) == sorted(tasks)
    assert rig.worker._db.resets == 2  # type: ignore[attr-defined]


def test_the_dependents_a_finish_releases_are_claimed_in_it_without_the_broker(rig: Rig) -> None:
    parent, child, grandchild = rig.store.add("fast", 3, state=TaskState.PENDING)
    rig.store.tasks[parent].state = TaskState.READY
    rig.store.then(parent, child)
    rig.store.then(child, grandchild)
    rig.broker.publish(parent, 1)
    rig.run()
    assert rig.ran == [parent, child, grandchild]
    assert rig.broker.takes() == [1]
    assert rig.store.count("claim_many") == 1  # the others were claimed by the finishes


def test_an_ack_that_fails_after_the_claim_still_finishes_the_batch(rig: Rig) -> None:
    [task] = rig.publish("fast")
    rig.broker.fail_acks = 1
    with pytest.raises(BrokerUnavailableError):
        rig.run()
    assert rig.ran == [task]
    assert rig.store.tasks[task].state is TaskState.SUCCEEDED


def test_a_worker_recycles_after_max_tasks_and_takes_no_more_than_it_may_run() -> None:
    made = make_rig(processes=ProcessesConfig(max_tasks_per_child=4))
    made.publish("fast", 10)
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.worker.recycle and made.finished.count == 4
    assert made.broker.takes() == [1, 2, 1]  # the last batch is capped by what is left
    assert len(made.broker.queue) == 6


def test_a_handler_past_its_timeout_fails_with_timeout_and_the_worker_recycles() -> None:
    made = make_rig(fast_ms=50.0)
    release = threading.Event()
    made.worker._handlers = {
        **(made.worker._handlers or {}),
        "stuck": lambda ctx: release.wait(BLOCK_S),
    }
    [task] = made.publish("stuck")
    made.store.tasks[task].timeout_s = 0.2
    try:
        made.run()
    finally:
        release.set()
        made.worker.shutdown()
    finish = made.store.tasks[task].finish
    assert finish is not None and (finish.state, finish.reason) == (
        TaskState.FAILED,
        FailureReason.TIMEOUT,
    )
    assert made.worker.recycle
    assert made.telemetry.tasks_failed.labels(reason="timeout").value() == 1


def test_while_a_slow_handler_runs_its_lease_is_renewed_and_a_cancel_reaches_it() -> None:
    made = make_rig(fast_ms=50.0, heartbeat_s=0.1)

    def polite(ctx: TaskContext) -> None:
        made.store.tasks[ctx.task_run_id].cancel_requested = True  # an operator's cancel
        if not ctx.cancelled.wait(BLOCK_S):
            raise AssertionError("the cancel never reached the handler")

    made.worker._handlers = {**(made.worker._handlers or {}), "polite": polite}
    [task] = made.publish("polite")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.store.count("renew_leases") >= 1
    assert made.store.tasks[task].state is TaskState.CANCELLED
    assert made.telemetry.tasks_cancelled.value() == 1


def test_a_handler_that_lost_its_lease_is_asked_to_stop_and_its_finish_is_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made = make_rig(fast_ms=50.0, heartbeat_s=0.1)

    def reaped(ctx: TaskContext) -> str:
        made.store.tasks[ctx.task_run_id].token += 1  # the reaper took the task back
        ctx.cancelled.wait(BLOCK_S)
        return "late"

    made.worker._handlers = {**(made.worker._handlers or {}), "reaped": reaped}
    [task] = made.publish("reaped")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert made.store.tasks[task].state is TaskState.RUNNING  # the finish changed nothing
    assert made.telemetry.stale_completions.value() == 1
    assert any("stale completion" in r.getMessage() for r in caplog.records)
    assert made.finished.count == 1


def test_a_handler_name_no_module_registered_fails_the_task(rig: Rig) -> None:
    [task] = rig.publish("nobody.registered")
    rig.run()
    finish = rig.store.tasks[task].finish
    assert finish is not None and finish.reason is FailureReason.UNKNOWN_HANDLER


# ------------------------------------------------------------------ hooks


class Recorder(Hook):
    """Records every hook call, and the thread it came on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.threads: set[str] = set()

    def _note(self, name: str, data: Any) -> None:
        self.calls.append((name, data))
        self.threads.add(threading.current_thread().name)

    def after_claim(self, claims: Sequence[Claim]) -> None:
        self._note("after_claim", [c.task_run_id for c in claims])

    def after_execute(self, claim: Claim, finish: Finish, duration_s: float) -> None:
        assert duration_s >= 0
        self._note("after_execute", (claim.task_run_id, finish.state))

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        self._note("after_finish", {c.task_run_id for c, _ in outcomes} == set(committed))

    def after_batch(self, slow: bool) -> None:
        self._note("after_batch", slow)


def test_a_registered_hook_hears_claim_execute_finish_and_batch_on_the_main_thread() -> None:
    recorder = Recorder()
    made = make_rig()
    made.worker = Worker(
        made.worker._config,
        made.telemetry,
        handlers=made.worker._handlers,
        broker=made.broker,
        store=made.store,
        db=NullPool(),
        hooks=[recorder],
    )
    first, second, third = made.publish("fast", 3)
    try:
        made.run()
    finally:
        made.worker.shutdown()
    ok = TaskState.SUCCEEDED
    assert recorder.calls == [
        ("after_claim", [first]),
        ("after_execute", (first, ok)),
        ("after_finish", True),
        ("after_batch", False),
        ("after_claim", [second, third]),
        ("after_execute", (second, ok)),
        ("after_execute", (third, ok)),
        ("after_finish", True),
        ("after_batch", False),
    ]
    assert recorder.threads == {threading.current_thread().name}


def test_hooks_dispatch_only_to_the_hooks_that_override_a_method() -> None:
    class Room(Hook):
        def __init__(self, room: int | None) -> None:
            self._room = room

        def room(self, finishing: int) -> int | None:
            return None if self._room is None else self._room - finishing

    class Wake(Hook):
        def __init__(self, said: float | Finish | None) -> None:
            self._said = said

        def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
            return self._said

    hooks = Hooks([Room(5), Room(None), Room(3), Wake(None), Wake(2.0), Wake(0.5)])
    assert len(hooks._after_finish) == 0 and len(hooks._room) == 3
    assert hooks.room(1) == 2
    claim = Claim(uuid.uuid4(), uuid.uuid4(), "t", "h", 1, 1, {})
    assert hooks.while_running(claim, 0.0) == 0.5
    stop = Finish(TaskState.FAILED, reason=FailureReason.TIMEOUT)
    assert Hooks([Wake(0.1), Wake(stop)]).while_running(claim, 0.0) is stop
    assert Hooks([]).room(0) is None


def test_a_broker_call_blocked_longer_than_a_heartbeat_does_not_stop_lease_renewal() -> None:
    """A quorum queue's ``basic.cancel`` can block the main thread for up to RabbitMQ's 30 s
    command timeout while a new leader is elected; the leases are renewed meanwhile by their
    own thread, and the finish that follows commits with the claim's token."""
    made = make_rig(fast_ms=50.0, heartbeat_s=0.05)
    handed_back = StubBroker.hand_back
    renewals_during_block: list[int] = []

    def blocked_hand_back(broker: StubBroker = made.broker) -> int:
        before = made.store.count("renew_leases")
        # blocked until the keeper renewed three times (a bound, not a wait: BLOCK_S)
        wait_for(
            lambda: made.store.count("renew_leases") >= before + 3,
            timeout=BLOCK_S,
            what="renewals while the main thread is blocked in a broker call",
        )
        renewals_during_block.append(made.store.count("renew_leases") - before)
        return handed_back(broker)

    made.broker.hand_back = blocked_hand_back  # type: ignore[method-assign]
    release = threading.Event()

    def slow(ctx: TaskContext) -> str:
        release.wait(0.2)  # slower than fast_handler_ms: the worker hands back behind it
        return "done"

    made.worker._handlers = {**(made.worker._handlers or {}), "slow": slow}
    [task] = made.publish("slow")
    try:
        made.run()
    finally:
        made.worker.shutdown()
    assert renewals_during_block and renewals_during_block[0] >= 3
    # committed (a stale token would have left the task RUNNING), and on its first attempt
    assert made.store.tasks[task].state is TaskState.SUCCEEDED
    assert made.store.tasks[task].attempt == 1


def test_a_task_the_handler_thread_starts_during_a_hand_back_is_waited_for_and_finished() -> None:
    """The race behind a stuck (or, before leases renewed on their own, twice executed) task:
    the main thread decides the running handler is slow, but before it withdraws the jobs
    behind it the handler ends and the handler thread starts the next one. That job cannot be
    handed back; the batch must wait for it and finish it, not leave its claim held."""
    first_release = threading.Event()
    second_started = threading.Event()
    second_release = threading.Event()
    order: list[str] = []

    def gated(ctx: TaskContext) -> str:
        position = len(order)
        order.append(str(ctx.task_run_id))
        if position == 0:  # the slow one: until the hook has seen it slow
            assert first_release.wait(BLOCK_S)
        elif position == 1:  # started by the handler thread while the main thread hands back
            second_started.set()
            assert second_release.wait(BLOCK_S)
        return "done"

    class Race(Hook):
        """Holds the main thread, once, between seeing the first handler slow and handing
        back, until the handler thread has moved on to the second job."""

        def __init__(self) -> None:
            self.raced = False

        def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
            if not self.raced and elapsed_s > 0.05 and order:
                self.raced = True
                first_release.set()
                assert second_started.wait(BLOCK_S)
            return None

    made = make_rig(fast_ms=50.0)
    race = Race()
    made.worker = Worker(
        made.worker._config,
        made.telemetry,
        handlers={**(made.worker._handlers or {}), "gated": gated},
        broker=made.broker,
        store=made.store,
        db=NullPool(),
        hooks=[race],
    )
    handed_back = StubBroker.hand_back

    def hand_back_then_let_the_second_end(broker: StubBroker = made.broker) -> int:
        requeued = handed_back(broker)
        second_release.set()  # the second job ends only once the hand-back is under way
        return requeued

    made.broker.hand_back = hand_back_then_let_the_second_end  # type: ignore[method-assign]
    made.store.on_release = made.broker.publish  # the publisher's part: the new outbox row
    made.publish("fast", 1 + 2)  # the window grows to 4: the next take is one batch of three
    gated_ids = made.publish("gated", 3)
    try:
        made.run()
    finally:
        second_release.set()
        first_release.set()
        made.worker.shutdown()
    assert race.raced, "the race was not staged"
    first, second, third = gated_ids
    assert made.store.tasks[first].state is TaskState.SUCCEEDED
    # started during the hand-back: waited for and finished, not left RUNNING
    assert made.store.tasks[second].state is TaskState.SUCCEEDED
    # never started: handed back, then run again by this worker from the queue
    assert made.store.tasks[third].state is TaskState.SUCCEEDED
    assert made.store.tasks[third].attempt == 1
    assert order.count(str(second)) == 1
