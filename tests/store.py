"""Every part of the store in one object, for tests that drive the engine statement by statement.

The product gives each caller only the parts it uses (``WorkerStatements`` in roles/worker.py,
``ClientStatements`` in client.py, ``ApiStatements`` in api/app.py, ``CliStatements`` in
cli/statements.py, ...). A test plays every caller at once — it triggers, claims, finishes,
runs the scheduler's passes and reads — so it composes them all here, with the one-task
conveniences only tests use (:meth:`Store.claim`, :meth:`Store.finish`,
:meth:`Store.renew_lease`) and the counters no product caller reads (:meth:`Store.counters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from flowforge.domain.model import ClaimResult, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.store.breakers import Gates
from flowforge.store.children import Children
from flowforge.store.claims import Claims
from flowforge.store.control import Control
from flowforge.store.events import Events
from flowforge.store.limits import Limits
from flowforge.store.maps import Maps
from flowforge.store.operator import Operator
from flowforge.store.outbox import Outbox
from flowforge.store.passes import Passes
from flowforge.store.processes import Processes
from flowforge.store.schedules import Schedules
from flowforge.store.timelines import Timelines
from flowforge.store.triggers import Triggers


@dataclass(frozen=True)
class Renewal:
    """One lease's renewal: ``held`` is False once the token is stale."""

    held: bool
    cancel_requested: bool = False


class Store(
    Triggers,
    Passes,
    Claims,
    Outbox,
    Processes,
    Operator,
    Schedules,
    Maps,
    Events,
    Children,
    Control,
    Limits,
    Gates,
    Timelines,
):
    """Triggers, scheduler passes, claims, the outbox, the registry, operator actions and
    reads (``Operator`` answers with the read models) over one ``Database``.

    ``rand`` (a float in [0, 1)) feeds retry jitter; the ``repo`` fixture fixes it at 0.5.
    """

    def claim(
        self, task_run_id: UUID, token: int, worker: str, lease_s: float, key_wait_s: float = 1.0
    ) -> ClaimResult:
        """READY → RUNNING for the generation ``token`` names (``claim_many`` of one pair)."""
        return self.claim_many([(task_run_id, token)], worker, lease_s, key_wait_s)[0]

    def finish(
        self,
        task_run_id: UUID,
        token: int,
        state: TaskState,
        *,
        result: Any = None,
        reason: FailureReason | None = None,
        error: str | None = None,
        traceback: str | None = None,
    ) -> bool:
        """RUNNING → ``state`` if ``token`` is current (``finish_many`` of one task); False
        for a stale token."""
        outcome = Finish(state, result, reason, error, traceback)
        return bool(self.finish_many([(task_run_id, token, outcome)]).committed)

    def renew_lease(self, task_run_id: UUID, token: int, lease_s: float) -> Renewal:
        """Extend one held lease by ``lease_s`` (``renew_leases`` of one pair)."""
        held = self.renew_leases([(task_run_id, token)], lease_s)
        return Renewal(held=task_run_id in held, cancel_requested=held.get(task_run_id, False))

    def counters(self) -> dict[str, int]:
        """The ``counters`` table (``stale_completions``, ...): read by tests and by operators
        with SQL; no product code reads it back."""
        found = self._db.execute(b"SELECT name, value FROM counters ORDER BY name")
        return {row["name"]: int(row["value"]) for row in found}


#: The store's parts, each a class of the product (store/part.py's ``Part``): Store's bases.
PARTS: tuple[type, ...] = Store.__bases__
