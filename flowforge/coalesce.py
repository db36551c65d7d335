"""Group commit for :meth:`Client.trigger <flowforge.Client.trigger>`: the runs that one
process's threads ask for at the same time are created in one transaction.

A call that finds no trigger committing commits its own run at once, alone: a lone caller (a
loop, the CLI) waits for nothing and runs exactly the statements it always ran. Calls that
arrive while a trigger commits queue; when it is done, one of them (the leader) takes everything
queued — at most ``limit`` — and creates those runs in one transaction
(:meth:`~flowforge.Client.trigger_batch`), then hands each call its own result. Each call's
answer is the one it would get alone: its run, its idempotency key replayed or refused, its own
error. The transaction is all or nothing, so when a batch fails for a reason one call can cause
— a bad value, a key used for another request, a defect — every call of it is tried again alone,
and only the one at fault fails. An outage is everyone's: each call of the batch gets the same
:class:`~flowforge.errors.DatabaseUnavailableError`, without trying again alone. A leader whose
thread is stopped mid-commit (a ``BaseException``) leaves the other calls of its batch a
:class:`~flowforge.errors.StoreError` saying so (:data:`INTERRUPTED`: their runs may exist), so
none waits forever.

Why (docs/performance.md "Submitting work, part 5"): a trigger's cost is mostly per
transaction — its round trip, the statements' executions in psycopg and in PostgreSQL, the
commit's WAL flush — and the api's request threads (``POST /api/v1/runs``, 16 of them) spent
more CPU handing Python's GIL to one another around those waits than on the requests.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from flowforge.domain.model import TriggerResult
from flowforge.domain.plan import RunRequest
from flowforge.errors import DatabaseUnavailableError, StoreError

#: Runs one shared transaction creates at most (the rest wait for the next).
DEFAULT_LIMIT = 64
#: What the other calls of a batch get when its leader's thread is stopped mid-commit.
INTERRUPTED = (
    "the shared trigger was interrupted (its thread stopped) before it answered: the run may"
    " have been created; send it again with the same idempotency key"
)


class _Pending:
    """One request's place in the queue, and its result or error once settled."""

    __slots__ = ("done", "error", "request", "result", "with_run")

    def __init__(self, request: RunRequest, with_run: bool) -> None:
        self.request = request
        self.with_run = with_run
        self.result: TriggerResult | None = None
        self.error: BaseException | None = None
        self.done = False

    def outcome(self) -> TriggerResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None  # settled: a result or an error
        # a batch answers every run when one of its calls asked: the others did not
        if self.with_run or self.result.run is None:
            return self.result
        return replace(self.result, run=None)


class Coalescer:
    """Creates each request's run, sharing transactions between concurrent calls (module
    docstring). ``one(request, with_run)`` creates one run alone, as a lone call always does;
    ``many(requests, with_run)`` creates several in one transaction (all or nothing), the
    results in the requests' order; ``with_run`` asks each result to carry its run as written.
    Thread-safe: call :meth:`trigger` from any number of threads."""

    def __init__(
        self,
        one: Callable[[RunRequest, bool], TriggerResult],
        many: Callable[[Sequence[RunRequest], bool], list[TriggerResult]],
        limit: int = DEFAULT_LIMIT,
    ) -> None:
        if limit < 1:
            raise ValueError("a batch holds at least one run")
        self._one = one
        self._many = many
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._leading = False

    def trigger(self, request: RunRequest, with_run: bool = False) -> TriggerResult:
        """``request``'s run created (or its key replayed), with the run as written when
        ``with_run`` (as ``one`` answers it); raises what creating it alone would raise."""
        pending = _Pending(request, with_run)
        with self._cond:
            self._queue.append(pending)
        while True:
            batch = self._lead(pending)
            if not batch:
                return pending.outcome()
            try:
                self._commit(batch)
            finally:
                self._step_down()

    def _lead(self, pending: _Pending) -> list[_Pending]:
        """Wait until ``pending`` is settled (then: nothing) or nobody leads; then lead: take
        the queue's oldest requests, up to the limit (``pending`` among them unless more than
        the limit queued before it: then it leads again after)."""
        with self._cond:
            while self._leading and not pending.done:
                self._cond.wait()
            if pending.done:
                return []
            self._leading = True
            take = min(self._limit, len(self._queue))
            return [self._queue.popleft() for _ in range(take)]

    def _step_down(self) -> None:
        with self._cond:
            self._leading = False
            self._cond.notify_all()  # the settled return; the first other one awake leads

    def _commit(self, batch: list[_Pending]) -> None:
        """Settle every request of ``batch`` (each marked done, whatever happens)."""
        try:
            if len(batch) == 1:
                _settle(batch[0], self._one)
                return
            try:
                with_run = any(p.with_run for p in batch)
                results = self._many([p.request for p in batch], with_run)
            except DatabaseUnavailableError as exc:  # everyone's outage: not one by one
                for pending in batch:
                    pending.error = exc
                return
            except Exception:  # a request's fault: each alone says whose
                for pending in batch:
                    _settle(pending, self._one)
                return
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        finally:
            for pending in batch:
                if pending.result is None and pending.error is None:  # a BaseException
                    # not an outage, nor the caller's: the commit may or may not have happened
                    pending.error = StoreError(INTERRUPTED)
                pending.done = True


def _settle(pending: _Pending, one: Callable[[RunRequest, bool], TriggerResult]) -> None:
    try:
        pending.result = one(pending.request, pending.with_run)
    except Exception as exc:  # handed to the request's own thread, raised there
        pending.error = exc
