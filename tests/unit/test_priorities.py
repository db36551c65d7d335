"""Priorities (issue 20, SPEC 7.4; docs/flow-control.md "Priorities"), the parts without
services: a priority refused by class of bad value on every path that takes one (a task in
YAML and in Python, a trigger), the digest only when set, the band of each priority, the
trigger's priority over the tasks' own, the consumer's highest-band-first take and its exact
acks per band (the real :class:`~flowforge.broker.consume.Consumer` over recording channels),
and the worker loop taking a priority-9 dispatch ahead of a backlog (stub broker).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import pytest

from flowforge.broker.consume import Consumer
from flowforge.config import BrokerConfig
from flowforge.definitions import workflow_from_mapping
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.names import BANDS, band, band_queue, priority_problem
from flowforge.domain.plan import plan_runs
from flowforge.domain.states import TaskState
from flowforge.errors import DatabaseUnavailableError, DefinitionError, InputError
from flowforge.roles.context import TaskContext
from flowforge.roles.intake import BatchCost, Intake
from flowforge.store import queries
from tests.helpers import wait_for
from tests.unit.test_worker_loop import make_rig

SQL = Path(queries.__file__).with_name("queries.sql").read_text()

#: Priorities refused, one per class: over 9, negative, a bool, a float, text, None.
BAD_PRIORITIES: list[Any] = [10, -1, True, 1.0, "5", None]


@pytest.mark.parametrize("priority", BAD_PRIORITIES, ids=repr)
def test_a_task_priority_is_a_whole_number_from_0_to_9(priority: Any) -> None:
    with pytest.raises(DefinitionError, match="task 'a': priority must be a whole number"):
        TaskDef("a", "h.a", priority=priority)


@pytest.mark.parametrize("priority", BAD_PRIORITIES, ids=repr)
def test_a_yaml_task_priority_is_refused_at_its_key(priority: Any) -> None:
    task = {"name": "a", "handler": "h.a", "priority": priority}
    with pytest.raises(DefinitionError, match=r"priority"):
        workflow_from_mapping({"name": "wf", "tasks": [task]}, "wf.yaml")


@pytest.mark.parametrize("priority", BAD_PRIORITIES, ids=repr)
def test_a_trigger_priority_is_a_whole_number_from_0_to_9(priority: Any) -> None:
    wf = WorkflowDef("wf", (TaskDef("a", "h.a"),))
    if priority is None:  # None is "not given" for a trigger: the tasks keep their own
        assert plan_runs(wf, [{}], priority=priority).tasks[0].priority == 0
        return
    with pytest.raises(InputError, match=r"^priority must be a whole number from 0 to 9"):
        plan_runs(wf, [{}], priority=priority)


@pytest.mark.parametrize("priority", range(10))
def test_every_priority_from_0_to_9_is_taken(priority: int) -> None:
    assert priority_problem(priority) is None
    task = workflow_from_mapping(
        {"name": "wf", "tasks": [{"name": "a", "handler": "h.a", "priority": priority}]}
    ).tasks[0]
    assert task.priority == priority


def test_priority_enters_the_digest_only_when_set() -> None:
    plain = WorkflowDef("wf", (TaskDef("a", "h.a"),))
    zero = WorkflowDef("wf", (TaskDef("a", "h.a", priority=0),))
    five = WorkflowDef("wf", (TaskDef("a", "h.a", priority=5),))
    assert "priority" not in plain.to_dict()["tasks"][0]
    assert plain.digest == zero.digest != five.digest
    assert five.to_dict()["tasks"][0]["priority"] == 5
    assert workflow_from_mapping(five.to_dict()) == five  # the canonical form reads back


def test_a_task_that_never_executes_takes_no_priority_and_a_map_passes_it_on() -> None:
    for kind in (
        {"sleep": 5.0},
        {"wait_for_event": EventWait("paid", "{order}", 60)},
        {"workflow": "child"},
    ):
        with pytest.raises(DefinitionError, match="takes no priority"):
            TaskDef("t", priority=3, **kind)  # type: ignore[arg-type]
    wf = WorkflowDef(
        "wf", (TaskDef("list", "h.list"), TaskDef("each", "h.each", for_each="list", priority=7))
    )
    assert [t.priority for t in plan_runs(wf, [{}]).tasks] == [0, 7]  # items copy their map's


def test_a_trigger_priority_replaces_every_task_own_and_none_keeps_them() -> None:
    wf = WorkflowDef(
        "wf", (TaskDef("a", "h.a", priority=2), TaskDef("b", "h.b", depends_on=("a",)))
    )
    assert [t.priority for t in plan_runs(wf, [{}]).tasks] == [2, 0]
    plan = plan_runs(wf, [{}, {}], priority=9)
    assert [t.priority for t in plan.tasks] == [9, 9, 9, 9] and plan.priority == 9
    assert plan_runs(wf, [{}]).priority is None  # a child run inherits None: its tasks' own


def test_three_bands_0_then_1_to_4_then_5_to_9_named_after_the_queue() -> None:
    assert BANDS == (0, 1, 5)
    assert [band(p) for p in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    assert [band_queue("shop", i) for i in range(3)] == ["shop", "shop.p1", "shop.p5"]


def test_the_publisher_takes_the_highest_priority_first_and_lost_dispatches_stay_in_band() -> None:
    lock = queries.readable()["lock_outbox"].decode()
    assert re.search(r"ORDER BY priority DESC, id\s+LIMIT", lock)
    lost = queries.readable()["redispatch_lost"].decode()
    assert "o.priority > 0 AS b1, o.priority >= 5 AS b5" in lost  # a candidate's band
    assert lost.count("(later.priority > 0) = g.b1 AND (later.priority >= 5) = g.b5") == 2
    assert "l.b1 = c.b1 AND l.b5 = c.b5" in lost


def test_every_insert_into_task_runs_carries_a_priority() -> None:
    inserts = re.findall(r"INSERT INTO task_runs \(([^)]*)\)", SQL)
    assert len(inserts) == 2  # insert_tasks and expand_map (items copy their map's)
    for columns in inserts:
        assert "priority" in [c.strip() for c in columns.split(",")], columns
    assert "m.id, s.idx, s.item, m.queue, m.priority" in SQL


# ---------------------------------------------------------------- the consumer, over fake channels


class RecordingChannel:
    """What :class:`Consumer` calls on a band's channel, recorded."""

    def __init__(self, calls: list[tuple[str, int, int]], index: int) -> None:
        self.calls, self.index = calls, index

    def basic_ack(self, tag: int, multiple: bool = False) -> None:
        assert multiple
        self.calls.append(("ack", self.index, tag))

    def basic_nack(self, tag: int, multiple: bool = False, requeue: bool = True) -> None:
        assert requeue and not multiple
        self.calls.append(("nack", self.index, tag))

    def basic_cancel(self, tag: str) -> None:
        self.calls.append(("cancel", self.index, 0))


class IdleConnection:
    is_open = False

    def process_data_events(self, time_limit: float = 0.0) -> None:
        return None


def consumer_with_bands(limit: int) -> tuple[Consumer, list[tuple[str, int, int]]]:
    consumer = Consumer(BrokerConfig(prefetch=limit))
    calls: list[tuple[str, int, int]] = []
    consumer._conn = IdleConnection()  # type: ignore[assignment]
    consumer._channels = [RecordingChannel(calls, i) for i in range(len(BANDS))]  # type: ignore[misc]
    consumer._consumer_tags = [f"ctag-{i}" for i in range(len(BANDS))]
    consumer._prefetch = limit
    return consumer, calls


def deliver(consumer: Consumer, index: int, tag: int) -> None:
    method = SimpleNamespace(delivery_tag=tag, redelivered=False)
    consumer._on_message(index, None, method, None, f"{index}:{tag}".encode())


def test_the_consumer_takes_the_highest_band_first_and_acks_each_band_through_its_last() -> None:
    consumer, calls = consumer_with_bands(limit=4)
    for tag in (1, 2, 3, 4):  # a full window of priority 0 (tags are per channel)
        deliver(consumer, 0, tag)
    deliver(consumer, 2, 1)  # then a priority-9 one, on its own channel's credit
    deliver(consumer, 1, 1)
    taken = consumer.take(4, 0.0)
    assert [(d.band, d.tag) for d in taken] == [(2, 1), (1, 1), (0, 1), (0, 2)]
    consumer.ack(taken)
    # exact: band 0 through 2 only (3 and 4 wait in the buffer, unacked), bands 1 and 2 each 1
    assert calls == [("ack", 0, 2), ("ack", 1, 1), ("ack", 2, 1)]
    calls.clear()
    deliver(consumer, 2, 2)  # a priority-9 one overtakes the two waiting
    taken = consumer.take(4, 0.0)
    assert [(d.band, d.tag) for d in taken] == [(2, 2), (0, 3), (0, 4)]
    consumer.ack(taken)
    assert calls == [("ack", 0, 4), ("ack", 2, 2)]


def test_the_consumer_hands_back_every_band_it_holds_on_its_own_channel() -> None:
    consumer, calls = consumer_with_bands(limit=1)
    deliver(consumer, 0, 1)
    deliver(consumer, 0, 2)
    deliver(consumer, 2, 7)
    taken = consumer.take(1, 0.0)
    assert [(d.band, d.tag) for d in taken] == [(2, 7)]
    assert consumer.hand_back() == 2
    cancels = [c for c in calls if c[0] == "cancel"]
    assert len(cancels) == len(BANDS)
    assert [c for c in calls if c[0] == "nack"] == [("nack", 0, 1), ("nack", 0, 2)]
    consumer.ack(taken)  # the taken one stays ours to ack
    assert calls[-1] == ("ack", 2, 7)


# ---------------------------------------------------------------- the worker loop (stub broker)


def test_a_priority_9_dispatch_published_behind_a_backlog_runs_in_the_next_batch() -> None:
    published: list[UUID] = []

    def first(ctx: TaskContext) -> None:
        if not published:  # while the first batch runs, a priority-9 task arrives
            (urgent,) = rig.store.add("urgent", 1)
            rig.broker.publish(urgent, 1, priority=9)
            published.append(urgent)

    ran: list[str] = []
    rig = make_rig(
        handlers={
            "backlog": lambda ctx: (first(ctx), ran.append("backlog")),
            "urgent": lambda ctx: ran.append("urgent"),
        }
    )
    try:
        rig.publish("backlog", 40)
        rig.run()
        assert ran.count("backlog") == 40 and ran.count("urgent") == 1
        # the first batch is one task (the window starts at 1): the urgent one is next
        assert ran.index("urgent") == 1, ran
        assert rig.broker.unacked == 0  # every delivery of every band acked, none twice
        assert sorted(rig.broker.acks()) == rig.broker.acks()
    finally:
        rig.worker.shutdown()


def test_deliveries_left_in_a_lower_band_stay_unacked_until_their_own_batch() -> None:
    rig = make_rig()
    try:
        backlog = rig.publish("fast", 8)
        urgent = rig.store.add("fast", 3)
        for task_id in urgent:
            rig.broker.publish(task_id, 1, priority=5)
        rig.run()
        order = rig.ran
        assert set(order[:3]) == set(urgent), order  # the first batches take band p5 first
        assert sorted(order) == sorted(backlog + urgent)
        assert rig.broker.unacked == 0
    finally:
        rig.worker.shutdown()


# ---------------------------------------------------------------- overtaking within a batch


def rig_with_an_arrival(
    priority: int, batch_priority: int = 0, fast_ms: float | None = None
) -> tuple[Any, list[str], list[UUID]]:
    """A rig whose 4th task (the first of the third batch: windows 1, 2, 4) publishes one
    task of ``priority``; its 5th waits until that one is claimed (or a bound), so the batch
    is still running when the worker looks. Returns the rig, the names run, the arrival."""
    ran: list[str] = []
    arrival: list[UUID] = []

    def backlog(ctx: TaskContext) -> None:
        ran.append("backlog")
        if len(ran) == 4:
            (urgent,) = rig.store.add("urgent", 1)
            rig.broker.publish(urgent, 1, priority=priority)
            arrival.append(urgent)
        elif len(ran) == 5 and priority > batch_priority:
            wait_for(lambda: rig.store.tasks[arrival[0]].state is TaskState.RUNNING)

    kwargs = {} if fast_ms is None else {"fast_ms": fast_ms}
    rig = make_rig(
        handlers={"backlog": backlog, "urgent": lambda ctx: ran.append("urgent")}, **kwargs
    )
    for task_id in rig.store.add("backlog", 12):
        rig.broker.publish(task_id, 1, priority=batch_priority)
    return rig, ran, arrival


def test_a_higher_band_delivery_runs_before_the_rest_of_the_batch_it_arrived_during() -> None:
    rig, ran, arrival = rig_with_an_arrival(priority=9)
    try:
        rig.run()
    finally:
        rig.worker.shutdown()
    # tasks 4-7 are one batch: the urgent one runs after the 4th, or the 5th if the handler
    # thread had started it (never after the 7th, as it would in the next batch)
    assert ran.index("urgent") in (4, 5), ran
    assert ran.count("urgent") == 1 and ran.count("backlog") == 12
    assert rig.broker.takes()[:3] == [1, 2, 4]
    # claimed alone while the batch ran, finished with it, acked with it (exact per band)
    trace = rig.trace("take", "take_above", "claim_many", "finish_many")
    third = [i for i, name in enumerate(trace) if name == "take"][2]
    assert trace[third : third + 5] == [
        "take",
        "claim_many",
        "take_above",
        "claim_many",
        "finish_many",
    ]
    assert ("claim_many", 1) in rig.journal and ("finish_many", 5) in rig.journal
    assert rig.broker.unacked == 0 and sorted(rig.broker.acks()) == rig.broker.acks()
    assert rig.store.tasks[arrival[0]].attempt == 1
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}


@pytest.mark.parametrize(("priority", "batch_priority"), [(0, 0), (5, 9), (1, 9)])
def test_a_delivery_of_the_batch_band_or_below_waits_for_a_batch_of_its_own(
    priority: int, batch_priority: int
) -> None:
    rig, ran, _arrival = rig_with_an_arrival(priority, batch_priority)
    try:
        rig.run()
    finally:
        rig.worker.shutdown()
    assert "take_above" not in [name for name, _ in rig.journal]
    assert ran.index("urgent") >= 7, ran  # not within the third batch (tasks 4-7)
    assert rig.broker.unacked == 0


def test_a_slow_handler_after_an_overtake_hands_back_what_waits_behind_it() -> None:
    rig, ran, arrival = rig_with_an_arrival(priority=9, fast_ms=200.0)
    handlers = dict(rig.worker._handlers or {})
    backlog = handlers["backlog"]

    def slow_fifth(ctx: TaskContext) -> None:
        backlog(ctx)
        if len(ran) == 5:  # slow once the urgent one is claimed: until the hand-back
            rig.store.released.wait(10.0)

    rig.worker._handlers = {**handlers, "backlog": slow_fifth}
    rig.store.on_release = rig.broker.publish  # the outbox row a release writes
    try:
        rig.run()
    finally:
        rig.worker.shutdown()
    assert ran.count("urgent") == 1 and ran.count("backlog") == 12  # each exactly once
    released = [size for name, size in rig.journal if name == "release_claims"]
    assert released in ([2], [3])  # 6 and 7 (and the urgent one unless it ran before 5)
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}
    assert rig.store.tasks[arrival[0]].attempt == 1  # a release un-counts its attempt
    assert rig.broker.unacked == 0


def test_an_overtaking_claim_that_fails_leaves_its_delivery_unacked_and_the_batch_finished() -> (
    None
):
    rig, ran, arrival = rig_with_an_arrival(priority=9)
    handlers = dict(rig.worker._handlers or {})
    backlog = handlers["backlog"]

    def fourth_breaks_the_store(ctx: TaskContext) -> None:
        if len(ran) == 3:
            rig.store.outages["claim_many"] = 1  # the overtaking claim meets an outage
        if len(ran) == 4:  # no wait for a claim that cannot happen
            ran.append("backlog")
            return
        backlog(ctx)

    rig.worker._handlers = {**handlers, "backlog": fourth_breaks_the_store}
    with pytest.raises(DatabaseUnavailableError):
        rig.run()
    assert ran.count("backlog") == 7 and "urgent" not in ran  # the third batch ran whole
    assert ("finish_many", 4) in rig.journal
    assert rig.broker.unacked == 1  # the urgent delivery only: requeued by the reconnect
    rig.worker.reset()  # what run_role does
    try:
        rig.run()
    finally:
        rig.worker.shutdown()
    assert ran.count("urgent") == 1 and ran.count("backlog") == 12
    assert rig.store.tasks[arrival[0]].attempt == 1
    assert set(rig.store.states().values()) == {TaskState.SUCCEEDED}


# ---------------------------------------------------------------- after a slow batch (the intake)


def slow_rig(slow: bool) -> tuple[Any, Any, list[UUID]]:
    from tests.stubs import StubBroker

    broker = StubBroker()
    broker.connect()
    intake = Intake(broker, prefetch=16, fast_s=0.05)
    intake.settle(slow, BatchCost())  # the last batch had (or had not) a slow handler
    ids = [UUID(int=n) for n in range(1, 4)]
    broker.publish(ids[0], 1)  # two of priority 0 and one of 9 wait in the queue
    broker.publish(ids[1], 1)
    broker.publish(ids[2], 1, priority=9)
    return broker, intake, ids


def test_after_a_slow_batch_a_worker_holds_nothing_while_it_runs_the_next() -> None:
    broker, intake, ids = slow_rig(slow=True)
    wanted, taken = intake.take(1, 0.0)  # window 1: the priority-9 one, highest first
    assert wanted == [(ids[2], 1)]
    # what came with the take (the first priority-0 one) went back, to the front of its band
    assert [e for e in broker.events if e[0] == "hand_back"] == [("hand_back", 1)]
    assert broker.unacked == 1 and len(broker.bands[0]) == 2
    late = UUID(int=9)
    broker.publish(late, 1, priority=9)  # urgent work that comes while this batch runs
    intake.serve()
    assert len(broker.bands[band(9)]) == 1  # still in the queue, for a worker that takes
    intake.ack(taken)
    intake.settle(False, BatchCost())
    assert intake.take(2, 0.0)[0][0] == (late, 1)  # consuming again at the next take


def test_after_a_fast_batch_the_worker_keeps_its_window_while_it_runs() -> None:
    broker, intake, ids = slow_rig(slow=False)
    wanted, _taken = intake.take(2, 0.0)
    assert wanted == [(ids[2], 1), (ids[0], 1)]
    assert not [e for e in broker.events if e[0] == "hand_back"]
    broker.publish(UUID(int=9), 1, priority=9)
    intake.serve()
    assert len(broker.bands[band(9)]) == 0  # pushed into this worker's window, as before
