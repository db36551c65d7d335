"""The worker's one seam for cross-cutting concerns: hooks around claim, execute and finish.

A concern (telemetry, recycling, time limits, the task log lines; later rate limits, circuit
breakers, captured output) is a :class:`Hook` subclass that overrides the methods it needs, in
the way dramatiq's middleware does. The worker calls each method through :class:`Hooks`, only
on the hooks that override it, so a method nobody implements costs one empty loop.

Every method is called on the worker's **main thread** (the one that serves the broker
connection), in registration order, and must not block: it runs between a batch's statements.
An exception from a hook propagates like the worker's own (a transient error makes the role
reconnect). Per call:

``room(finishing)``
    Before every batch is taken (and before a finish claims the dependents it releases):
    the most tasks this worker may still take, counting ``finishing`` outcomes not yet
    reported to :meth:`Hook.after_finish`; None for no limit. The worker still takes at
    least one task per batch from the broker: a hook that wants no more asks for recycling.
``after_claim(claims)``
    A batch's claims committed (leases set, not yet acked), before any of their handlers runs.
``while_running(claim, elapsed_s)``
    Whenever the worker wakes while ``claim``'s handler runs (at least every
    ``fast_handler_ms`` until it is slow, then about every second). None: nothing to say; a
    number: wake again within that many seconds; a :class:`Finish`: give the handler up with
    that outcome — the worker hands back what waits behind it, records the finish, and
    replaces itself once the batch is done (Python cannot stop a thread).
``after_execute(claim, finish, duration_s)``
    A handler returned or raised: ``finish`` is its classified outcome, not yet committed.
``after_finish(outcomes, committed)``
    A finish statement committed ``outcomes`` ((claim, finish) pairs, the finish as stored);
    ids not in ``committed`` were stale (their lease was lost). Not called for outcomes
    abandoned to the reaper.
``after_batch(slow)``
    A batch is done: its outcomes committed, its claims behind a slow handler handed back.

A hook that must ask for this worker to be replaced is given a :class:`Recycle` (see
:mod:`flowforge.roles.concerns` for the built-in hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

from flowforge.domain.model import Claim, Finish

#: The logger of every line the worker's parts write: operators filter on the worker's name.
WORKER_LOGGER = "flowforge.roles.worker"


class Recycle:
    """A request, from any hook, that this worker process be replaced after its batch."""

    def __init__(self) -> None:
        self.asked = False

    def ask(self) -> None:
        self.asked = True


class Hook:
    """A cross-cutting concern of the worker; every method does nothing (see module doc)."""

    def room(self, finishing: int) -> int | None:
        return None

    def after_claim(self, claims: Sequence[Claim]) -> None:
        pass

    def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
        return None

    def after_execute(self, claim: Claim, finish: Finish, duration_s: float) -> None:
        pass

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        pass

    def after_batch(self, slow: bool) -> None:
        pass


class Hooks:
    """The registered hooks, each method dispatched to the hooks that override it."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = tuple(hooks)
        self._room = self._overriding("room")
        self._after_claim = self._overriding("after_claim")
        self._while_running = self._overriding("while_running")
        self._after_execute = self._overriding("after_execute")
        self._after_finish = self._overriding("after_finish")
        self._after_batch = self._overriding("after_batch")

    def _overriding(self, name: str) -> list[Callable[..., Any]]:
        base = getattr(Hook, name)
        return [getattr(h, name) for h in self.hooks if getattr(type(h), name) is not base]

    def room(self, finishing: int) -> int | None:
        """The smallest room any hook leaves; None when none limits it."""
        least: int | None = None
        for fn in self._room:
            room = fn(finishing)
            if room is not None and (least is None or room < least):
                least = room
        return least

    def after_claim(self, claims: Sequence[Claim]) -> None:
        for fn in self._after_claim:
            fn(claims)

    def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
        """The first hook's Finish, else the soonest wake-up asked for, else None."""
        soonest: float | None = None
        for fn in self._while_running:
            said = fn(claim, elapsed_s)
            if isinstance(said, Finish):
                return said
            if said is not None and (soonest is None or said < soonest):
                soonest = said
        return soonest

    def after_execute(self, claim: Claim, finish: Finish, duration_s: float) -> None:
        for fn in self._after_execute:
            fn(claim, finish, duration_s)

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        for fn in self._after_finish:
            fn(outcomes, committed)

    def after_batch(self, slow: bool) -> None:
        for fn in self._after_batch:
            fn(slow)
