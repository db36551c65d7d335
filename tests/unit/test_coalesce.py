"""Client.trigger's group commit (flowforge/coalesce.py): concurrent calls share a transaction,
each gets its own answer, and one call's fault is its own.

The store is a stand-in: ``one`` and ``many`` record what they were asked and answer a result
per request (a run id derived from its input), or fail as a test says. Threads are held at
known points with events, so which requests share a batch is decided, not timed.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import pytest

from flowforge.coalesce import INTERRUPTED, Coalescer
from flowforge.domain.model import Run, TriggerResult
from flowforge.domain.plan import RunRequest
from flowforge.errormap import meaning
from flowforge.errors import (
    DatabaseUnavailableError,
    InputError,
    StoreError,
    TriggerConflictError,
    UnknownWorkflowError,
)

WAIT_S = 10.0


def request(n: int, workflow: str = "wf") -> RunRequest:
    return RunRequest(workflow, {"n": n})


def result_of(req: RunRequest, with_run: bool = False) -> TriggerResult:
    """The stand-in's result for ``req``: an id from its number, and (``with_run``) a run."""
    assert req.input is not None
    run = cast(Run, f"run {req.input['n']}") if with_run else None
    return TriggerResult(uuid.UUID(int=req.input["n"] + 1), created=True, run=run)


class Store:
    """``one`` and ``many`` as the Runs resource passes them, recording every call; ``bad``
    inputs fail with ``error`` (alone, and the batch that holds them); ``gate``, when set,
    holds the first call until released (the leader committing while others queue)."""

    def __init__(self, bad: Callable[[RunRequest], BaseException | None] = lambda r: None):
        self.bad = bad
        self.calls: list[tuple[str, list[int]]] = []
        self.with_run: list[bool] = []
        self.lock = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def hold_first(self) -> None:
        self.release.clear()

    def _enter(self, kind: str, requests: Sequence[RunRequest], with_run: bool) -> None:
        with self.lock:
            self.calls.append((kind, [r.input["n"] for r in requests if r.input]))
            self.with_run.append(with_run)
        self.entered.set()
        assert self.release.wait(WAIT_S)

    def one(self, req: RunRequest, with_run: bool) -> TriggerResult:
        self._enter("one", [req], with_run)
        error = self.bad(req)
        if error is not None:
            raise error
        return result_of(req, with_run)

    def many(self, requests: Sequence[RunRequest], with_run: bool) -> list[TriggerResult]:
        self._enter("many", requests, with_run)
        for req in requests:
            error = self.bad(req)
            if error is not None:
                raise error
        return [result_of(r, with_run) for r in requests]


def coalescer(store: Store, limit: int = 64) -> Coalescer:
    return Coalescer(store.one, store.many, limit)


def queued(co: Coalescer, count: int) -> bool:
    """Whether ``count`` requests wait in ``co``'s queue (white box: the test's only way to
    know a thread has arrived without sleeping)."""
    with co._cond:
        return len(co._queue) == count


def wait_until(check: Callable[[], bool]) -> None:
    for _ in range(int(WAIT_S / 0.005)):
        if check():
            return
        threading.Event().wait(0.005)
    raise AssertionError("not reached within the deadline")


def burst(
    co: Coalescer,
    store: Store,
    pool: ThreadPoolExecutor,
    numbers: Sequence[int],
    with_run: Sequence[int] = (),
) -> tuple[Future[TriggerResult], list[Future[TriggerResult]]]:
    """A first request held in its commit, then ``numbers`` queued behind it (those in
    ``with_run`` asking for their run), then released: the futures of the first and of the
    queued ones."""
    store.hold_first()
    first = pool.submit(co.trigger, request(0))
    assert store.entered.wait(WAIT_S)
    rest = []
    for count, n in enumerate(numbers, 1):
        rest.append(pool.submit(co.trigger, request(n), n in with_run))
        wait_until(functools.partial(queued, co, count))
    store.release.set()
    return first, rest


def test_a_lone_request_commits_alone_at_once() -> None:
    store = Store()
    assert coalescer(store).trigger(request(7)) == result_of(request(7))
    assert store.calls == [("one", [7])]


def test_requests_arriving_during_a_commit_share_the_next_one_in_order() -> None:
    store = Store()
    co = coalescer(store)
    with ThreadPoolExecutor(8) as pool:
        first, rest = burst(co, store, pool, [1, 2, 3, 4, 5])
        assert first.result(WAIT_S) == result_of(request(0))
        for n, future in enumerate(rest, 1):
            assert future.result(WAIT_S) == result_of(request(n))
    assert store.calls == [("one", [0]), ("many", [1, 2, 3, 4, 5])]


def test_a_batch_answers_runs_when_one_call_asked_and_only_to_those_that_asked() -> None:
    store = Store()
    co = coalescer(store)
    with ThreadPoolExecutor(8) as pool:
        _first, rest = burst(co, store, pool, [1, 2, 3], with_run=[2])
        results = [f.result(WAIT_S) for f in rest]
    assert [r.run for r in results] == [None, result_of(request(2), True).run, None]
    assert results == [result_of(request(n)) for n in (1, 2, 3)]  # the ids, created
    assert store.with_run == [False, True]  # alone without, the batch with (one asked)


def test_a_lone_call_passes_its_with_run_through() -> None:
    store = Store()
    co = coalescer(store)
    assert co.trigger(request(4), True).run == result_of(request(4), True).run
    assert co.trigger(request(5)).run is None
    assert store.with_run == [True, False]


def test_a_batch_holds_at_most_the_limit_and_the_rest_follow() -> None:
    store = Store()
    co = coalescer(store, limit=2)
    with ThreadPoolExecutor(8) as pool:
        first, rest = burst(co, store, pool, [1, 2, 3, 4, 5])
        results = [f.result(WAIT_S) for f in [first, *rest]]
    assert results == [result_of(request(n)) for n in range(6)]
    assert store.calls == [("one", [0]), ("many", [1, 2]), ("many", [3, 4]), ("one", [5])]


@pytest.mark.parametrize(
    "error",
    [
        InputError("priority must be 0 to 9"),
        UnknownWorkflowError("unknown workflow 'nope'"),
        TriggerConflictError("idempotency key 'k' was used for a different request"),
        RuntimeError("a defect of the batch path"),
    ],
)
def test_a_failed_batch_is_tried_again_one_by_one_and_only_the_faulty_request_fails(
    error: Exception,
) -> None:
    store = Store(bad=lambda r: error if r.input == {"n": 3} else None)
    co = coalescer(store)
    with ThreadPoolExecutor(8) as pool:
        first, rest = burst(co, store, pool, [1, 2, 3, 4])
        assert first.result(WAIT_S) == result_of(request(0))
        outcomes: dict[int, TriggerResult | Exception] = {}
        for n, future in enumerate(rest, 1):
            try:
                outcomes[n] = future.result(WAIT_S)
            except Exception as exc:  # the request's own error, raised in its own thread
                outcomes[n] = exc
    assert outcomes[3] is error
    for n in (1, 2, 4):
        assert outcomes[n] == result_of(request(n))
    assert store.calls == [
        ("one", [0]),
        ("many", [1, 2, 3, 4]),
        ("one", [1]),
        ("one", [2]),
        ("one", [3]),
        ("one", [4]),
    ]


def test_an_outage_fails_every_request_of_the_batch_without_trying_each() -> None:
    outage = DatabaseUnavailableError("database unavailable")
    store = Store(bad=lambda r: outage if r.input and r.input["n"] > 0 else None)
    co = coalescer(store)
    with ThreadPoolExecutor(8) as pool:
        first, rest = burst(co, store, pool, [1, 2, 3])
        assert first.result(WAIT_S) == result_of(request(0))
        for future in rest:
            with pytest.raises(DatabaseUnavailableError):
                future.result(WAIT_S)
    assert store.calls == [("one", [0]), ("many", [1, 2, 3])]


def test_a_lone_requests_error_is_its_own_unchanged() -> None:
    error = InputError("'start_at' is more than a minute in the past")
    store = Store(bad=lambda r: error)
    with pytest.raises(InputError) as raised:
        coalescer(store).trigger(request(1))
    assert raised.value is error
    assert store.calls == [("one", [1])]


def test_an_interrupted_leader_leaves_no_request_waiting() -> None:
    """A BaseException in the leader's commit (the thread being stopped) settles every request
    of its batch with an internal error saying so — not an outage, not the caller's fault —
    and the next request still commits."""

    class Stop(BaseException):
        pass

    store = Store()

    def stopped(requests: Sequence[RunRequest], with_run: bool) -> list[TriggerResult]:
        raise Stop

    co = Coalescer(store.one, stopped, 64)
    with ThreadPoolExecutor(8) as pool:
        store.hold_first()
        first = pool.submit(co.trigger, request(0))
        assert store.entered.wait(WAIT_S)
        rest = [pool.submit(co.trigger, request(n)) for n in (1, 2)]
        wait_until(lambda: queued(co, 2))
        store.release.set()
        assert first.result(WAIT_S) == result_of(request(0))
        errors = []
        for future in rest:
            try:
                future.result(WAIT_S)
            except BaseException as exc:
                errors.append(exc)
        assert sorted(type(e).__name__ for e in errors) == ["Stop", "StoreError"]
        assert [str(e) for e in errors if type(e) is StoreError] == [INTERRUPTED]
        assert meaning(next(e for e in errors if type(e) is StoreError)).status == 500
    assert co.trigger(request(9)) == result_of(request(9))


def test_many_threads_each_get_their_own_result() -> None:
    store = Store()
    co = coalescer(store, limit=5)
    numbers = range(1, 801)
    with ThreadPoolExecutor(16) as pool:
        futures = {n: pool.submit(co.trigger, request(n)) for n in numbers}
        for n, future in futures.items():
            assert future.result(WAIT_S) == result_of(request(n))
    committed = sorted(n for _, ns in store.calls for n in ns)
    assert committed == list(numbers)  # each exactly once
    assert all(len(ns) <= 5 for _, ns in store.calls)


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Coalescer(Store().one, Store().many, 0)
