"""What the worker needs of PostgreSQL, as a seam: the statements it runs, and its pool.

:class:`~flowforge.roles.worker.WorkerStatements` (the store's ``Claims`` and ``Processes``)
and :class:`~flowforge.store.db.Database` implement these; fast tests replace them with a fake
(``tests/stubs.py``). tests/unit/test_seams.py holds both to these signatures exactly. Every
method raises :class:`~flowforge.errors.DatabaseUnavailableError` when the database cannot be
reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol
from uuid import UUID

from flowforge.domain.model import ClaimResult, Continuation, Finish, Finished
from flowforge.domain.output import Captured


class Registry(Protocol):
    """The process registry a role's :class:`~flowforge.roles.presence.Presence` writes."""

    def register_process(
        self, process_id: UUID, host: str, pid: int, role: str, queue: str | None = None
    ) -> None: ...

    def deregister_process(self, process_id: UUID) -> None: ...


class WorkerStore(Registry, Protocol):
    """The store methods a worker calls (see the docstrings of ``store/claims.py``)."""

    def claim_many(
        self,
        wanted: Sequence[tuple[UUID, int]],
        worker: str,
        lease_s: float,
        key_wait_s: float = 1.0,
        *,
        local: bool = False,
    ) -> list[ClaimResult]: ...

    def finish_many(
        self,
        outcomes: Sequence[tuple[UUID, int, Finish]],
        offer: int | None = None,
        then: Continuation | None = None,
        queue: str | None = None,
        min_priority: int = 0,
    ) -> Finished: ...

    def release_claims(self, claims: Sequence[tuple[UUID, int]]) -> int: ...

    def renew_leases(
        self, claims: Sequence[tuple[UUID, int]], lease_s: float
    ) -> dict[UUID, bool]: ...

    def write_output(self, captured: Sequence[tuple[UUID, int, Captured]]) -> int: ...


class Pool(Protocol):
    """The worker's connection pool: opened by initialize, reset after an outage."""

    def open(self) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...
