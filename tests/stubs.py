"""In-memory stand-ins for RabbitMQ and PostgreSQL behind the worker's seams.

:class:`StubBroker` implements :class:`flowforge.broker.consume.Deliveries` the way
dramatiq's ``StubBroker`` stands for a real broker: a queue, prefetch, unacked deliveries,
multiple acks, requeue on hand-back and on close. :class:`FakeStore` implements
:class:`flowforge.roles.seams.WorkerStore` over a dict of tasks with the state, token and
attempt rules of ``claim`` / ``finish`` / ``release_claims`` (no keys, no ordering, no
retries: the statements themselves are proven against PostgreSQL in tests/integration). Both
record every call, so a test can count round trips and see what was acked when.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from flowforge.broker.consume import Delivery
from flowforge.broker.messages import encode
from flowforge.domain.model import (
    Claim,
    ClaimOutcome,
    ClaimResult,
    Continuation,
    Dispatch,
    Finish,
    Finished,
)
from flowforge.domain.names import BANDS, band
from flowforge.domain.output import Captured
from flowforge.domain.states import TaskState
from flowforge.errors import (
    BrokerUnavailableError,
    DatabaseUnavailableError,
    StoreError,
    TransactionConflictError,
)
from flowforge.roles.hooks import Hook


class StubBroker:
    """One task queue of three priority bands and one consumer per band, in memory (see module
    docstring): each band is a FIFO queue with its own prefetch (the take's limit) and its own
    unacked deliveries, as each band's channel of :class:`~flowforge.broker.consume.Consumer`
    has; a take returns the highest band first, and an ack acks per band through its last tag.

    ``on_idle`` is called when a take finds nothing to deliver (a test stops the worker
    there); ``fail_acks`` makes the next that many acks fail as a lost connection.
    """

    def __init__(
        self,
        on_idle: Callable[[], None] | None = None,
        journal: list[tuple[str, Any]] | None = None,
    ) -> None:
        self.on_idle = on_idle
        self.bands: list[collections.deque[tuple[bytes, bool]]] = [
            collections.deque() for _ in BANDS
        ]
        # ("take", (limit, taken)), ("ack", tag), …; shared with a FakeStore to see the order
        self.events: list[tuple[str, Any]] = [] if journal is None else journal
        self.fail_acks = 0
        self.connected = False
        self._consuming = False
        self._prefetch = 0
        self._buffers: list[collections.deque[Delivery]] = [collections.deque() for _ in BANDS]
        self._unacked: list[dict[int, bytes]] = [{} for _ in BANDS]
        self._tag = 0  # one counter for every band: a test reads acks as one sequence
        self.wakes = 0  # wake() calls (a stop ending a take's wait)

    @property
    def queue(self) -> collections.deque[tuple[bytes, bool]]:
        """The band of priority 0: the queue itself (every message before priorities)."""
        return self.bands[0]

    def publish(self, task_run_id: UUID, token: int, priority: int = 0) -> None:
        self.bands[band(priority)].append((encode(Dispatch(0, task_run_id, token)), False))

    def publish_raw(self, body: bytes) -> None:
        self.queue.append((body, False))

    @property
    def unacked(self) -> int:
        return sum(len(u) for u in self._unacked)

    def acks(self) -> list[int]:
        return [tag for name, tag in self.events if name == "ack"]

    def takes(self) -> list[int]:
        """The limit (prefetch) of every take that delivered something."""
        return [limit for name, (limit, got) in self._named("take") if got]

    def connect(self) -> None:
        self.connected = True
        self.events.append(("connect", None))

    def take(self, limit: int, timeout_s: float) -> list[Delivery]:
        self._require()
        self._prefetch, self._consuming = limit, True
        self.pump(timeout_s)
        taken: list[Delivery] = []
        for buffer in reversed(self._buffers):
            while buffer and len(taken) < limit:
                taken.append(buffer.popleft())
        self.events.append(("take", (limit, len(taken))))
        if not taken and self.on_idle is not None:
            self.on_idle()
        return taken

    def take_above(self, band: int, limit: int) -> list[Delivery]:
        self.pump(0.0)
        taken: list[Delivery] = []
        for buffer in reversed(self._buffers[band + 1 :]):
            while buffer and len(taken) < limit:
                taken.append(buffer.popleft())
        if taken:
            self.events.append(("take_above", (band, [d.tag for d in taken])))
        return taken

    def waiting(self) -> bool:
        """As the Consumer's: True while not consuming (what waits is not pushed here), else
        whether a delivery is buffered once the queue pushed what the prefetch lets in."""
        self._require()
        self.events.append(("waiting", None))
        if not self._consuming:
            return True
        self.pump(0.0)
        return any(self._buffers)

    def pump(self, time_limit_s: float = 0.0) -> None:
        self._require()
        for index, queue in enumerate(self.bands):
            while self._consuming and queue and len(self._unacked[index]) < self._prefetch:
                body, redelivered = queue.popleft()
                self._tag += 1
                self._unacked[index][self._tag] = body
                self._buffers[index].append(Delivery(self._tag, body, redelivered, index))

    def wake(self) -> None:
        """No take here waits (pump fills the buffers at once): count the call."""
        self.wakes += 1

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self._require()
        if self.fail_acks:
            self.fail_acks -= 1
            self.connected = False
            raise BrokerUnavailableError("stub: the connection broke on ack")
        last: dict[int, int] = {}
        for delivery in deliveries:
            last[delivery.band] = max(delivery.tag, last.get(delivery.band, 0))
        self.events.append(("ack", max(last.values())))
        for index, tag in last.items():  # a multiple ack per band, as on its channel
            for acked in [t for t in self._unacked[index] if t <= tag]:
                del self._unacked[index][acked]

    def hand_back(self) -> int:
        self._require()
        self._consuming = False
        self.events.append(("hand_back", sum(len(b) for b in self._buffers)))
        requeued = 0
        for index, buffer in enumerate(self._buffers):
            for delivery in reversed(buffer):
                del self._unacked[index][delivery.tag]
                self.bands[index].appendleft((delivery.body, True))
            requeued += len(buffer)
            buffer.clear()
        return requeued

    def resume(self) -> None:
        """Consume again (after :meth:`hand_back`), with the last take's prefetch."""
        self._require()
        self._consuming = True
        self.events.append(("resume", None))

    def close(self) -> None:
        """Everything unacked goes back to the front of its band's queue, redelivered."""
        self.events.append(("close", self.unacked))
        for index, unacked in enumerate(self._unacked):
            for tag in sorted(unacked, reverse=True):
                self.bands[index].appendleft((unacked[tag], True))
            unacked.clear()
            self._buffers[index].clear()
        self.connected = self._consuming = False

    def _named(self, name: str) -> list[tuple[str, Any]]:
        return [e for e in self.events if e[0] == name]

    def _require(self) -> None:
        if not self.connected:
            raise BrokerUnavailableError("stub: not connected")


@dataclass
class FakeTask:
    id: UUID
    handler: str
    state: TaskState = TaskState.READY
    token: int = 1
    attempt: int = 0
    run_id: UUID = field(default_factory=uuid.uuid4)
    dependents: list[UUID] = field(default_factory=list)
    finish: Finish | None = None
    timeout_s: float | None = None
    cancel_requested: bool = False  # its run was asked to stop
    live: list[Captured] = field(default_factory=list)  # what write_output wrote while it ran
    payload_bytes: int = 0  # what its claim says it carries (the claim query's payload_bytes)


class FakeStore:
    """The worker's statements over a dict of tasks (see module docstring).

    ``outages[method]`` makes the next that many calls of ``method`` fail as an outage,
    ``conflicts[method]`` as a conflict the ``Database`` gave up on; ``refuse(finish)`` True
    makes a finish statement holding that finish fail for its content (as PostgreSQL refusing a
    value). ``on_release`` receives every (task, token) a
    ``release_claims`` made READY again (a publisher's outbox row: tests publish it).
    """

    def __init__(self, journal: list[tuple[str, Any]] | None = None) -> None:
        self.tasks: dict[UUID, FakeTask] = {}
        # (method, pairs in it); shared with a StubBroker to see the order
        self.calls: list[tuple[str, Any]] = [] if journal is None else journal
        self.outages: collections.Counter[str] = collections.Counter()
        self.conflicts: collections.Counter[str] = collections.Counter()
        self.refuse: Callable[[Finish], bool] = lambda finish: False
        self.on_release: Callable[[UUID, int], None] = lambda task, token: None
        self.released = threading.Event()
        self.processes: set[UUID] = set()
        self._lock = threading.Lock()

    def add(
        self, handler: str, count: int = 1, *, state: TaskState = TaskState.READY
    ) -> list[UUID]:
        ids = [uuid.uuid4() for _ in range(count)]
        for task_id in ids:
            self.tasks[task_id] = FakeTask(task_id, handler, state)
        return ids

    def then(self, parent: UUID, child: UUID) -> None:
        """``child`` becomes READY when ``parent`` succeeds."""
        self.tasks[parent].dependents.append(child)

    def count(self, method: str) -> int:
        return sum(1 for name, _ in self.calls if name == method)

    def states(self) -> dict[UUID, TaskState]:
        return {t.id: t.state for t in self.tasks.values()}

    # ------------------------------------------------------------------ WorkerStore

    def claim_many(
        self,
        wanted: Sequence[tuple[UUID, int]],
        worker: str,
        lease_s: float,
        key_wait_s: float = 1.0,
        *,
        local: bool = False,
    ) -> list[ClaimResult]:
        self._called("claim_many", len(wanted))
        results = []
        for task_id, token in wanted:
            task = self.tasks.get(task_id)
            if task is None or task.state is not TaskState.READY or task.token != token:
                results.append(ClaimResult(ClaimOutcome.LOST))
            else:
                results.append(ClaimResult(ClaimOutcome.EXECUTE, self._claim(task)))
        return results

    def finish_many(
        self,
        outcomes: Sequence[tuple[UUID, int, Finish]],
        offer: int | None = None,
        then: Continuation | None = None,
        queue: str | None = None,  # every fake task is on the worker's queue
        min_priority: int = 0,  # and of priority 0: a reserved worker's finish offers none
    ) -> Finished:
        self._called("finish_many", len(outcomes))
        if any(self.refuse(finish) for _, _, finish in outcomes):
            raise StoreError("fake: invalid input syntax for type json")
        committed: set[UUID] = set()
        ready: list[tuple[UUID, int]] = []
        for task_id, token, finish in outcomes:
            task = self.tasks[task_id]
            if task.state is not TaskState.RUNNING or task.token != token:
                continue
            task.state, task.finish = finish.state, finish
            committed.add(task_id)
            if finish.state is TaskState.SUCCEEDED:
                for child_id in task.dependents:
                    child = self.tasks[child_id]
                    child.state, child.token = TaskState.READY, child.token + 1
                    ready.append((child_id, child.token))
        ready = ready[:offer] if offer is not None else ready
        ready = ready if min_priority == 0 else []
        claimed = (
            [] if then is None else [self._claim(self.tasks[t]) for t, _ in ready[: then.limit]]
        )
        return Finished(frozenset(committed), tuple(ready), tuple(claimed))

    def release_claims(self, claims: Sequence[tuple[UUID, int]]) -> int:
        self._called("release_claims", len(claims))
        released = []
        for task_id, token in claims:
            task = self.tasks[task_id]
            if task.state is TaskState.RUNNING and task.token == token:
                task.state, task.token, task.attempt = TaskState.READY, token + 1, task.attempt - 1
                released.append((task_id, task.token))
        for task_id, token in released:
            self.on_release(task_id, token)
        self.released.set()
        return len(released)

    def renew_leases(self, claims: Sequence[tuple[UUID, int]], lease_s: float) -> dict[UUID, bool]:
        self._called("renew_leases", len(claims))
        return {
            t: self.tasks[t].cancel_requested
            for t, token in claims
            if self.tasks[t].state is TaskState.RUNNING and self.tasks[t].token == token
        }

    def write_output(self, captured: Sequence[tuple[UUID, int, Captured]]) -> int:
        self._called("write_output", len(captured))
        written = 0
        for task_id, token, found in captured:
            task = self.tasks[task_id]
            if task.state is TaskState.RUNNING and task.token == token:
                task.live.append(found)
                written += 1
        return written

    def register_process(
        self, process_id: UUID, host: str, pid: int, role: str, queue: str | None = None
    ) -> None:
        self._called("register_process", 1)
        self.processes.add(process_id)

    def deregister_process(self, process_id: UUID) -> None:
        self.processes.discard(process_id)

    def _claim(self, task: FakeTask) -> Claim:
        task.state, task.token, task.attempt = TaskState.RUNNING, task.token + 1, task.attempt + 1
        return Claim(
            task.id,
            task.run_id,
            "only",
            task.handler,
            task.attempt,
            task.token,
            {},
            timeout_s=task.timeout_s,
            payload_bytes=task.payload_bytes,
        )

    def _called(self, method: str, size: int) -> None:
        with self._lock:  # the main thread and the lease keeper both call in
            self.calls.append((method, size))
            if self.outages[method]:
                self.outages[method] -= 1
                raise DatabaseUnavailableError(f"fake: {method} could not reach the database")
            if self.conflicts[method]:
                self.conflicts[method] -= 1
                raise TransactionConflictError(f"fake: {method}: deadlock detected")


class Outcomes(Hook):
    """A hook that counts the outcomes a worker's finish statements took (committed or found
    stale): what a test asks of a worker when it asks how many tasks it finished."""

    def __init__(self) -> None:
        self.count = 0

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        self.count += len(outcomes)


class NullPool:
    """A pool with nothing to open (the fake store needs no connection)."""

    def __init__(self) -> None:
        self.resets = 0

    def open(self) -> None:
        pass

    def reset(self) -> None:
        self.resets += 1

    def close(self) -> None:
        pass
