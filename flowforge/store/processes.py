"""The process registry: every role registers, reports it is alive, and deregisters."""

from __future__ import annotations

from uuid import UUID

from flowforge.domain.model import ProcessInfo
from flowforge.store import rows
from flowforge.store.part import Part, Tx


class Processes(Part):
    """Rows of ``processes``: who runs where, last seen when."""

    def register_process(
        self, process_id: UUID, host: str, pid: int, role: str, queue: str | None = None
    ) -> None:
        """Insert or refresh this process's row (its ``last_seen_at`` is the database's now);
        ``queue``: the queue a worker consumes (None for the other roles)."""
        params = {"id": process_id, "host": host, "pid": pid, "role": role, "queue": queue}
        self._query("register_process", params)

    def deregister_process(self, process_id: UUID) -> None:
        """Remove this process's row (a clean exit)."""
        self._query("deregister_process", {"id": process_id})

    def forget_silent_processes(self, age_s: float) -> int:
        """Remove rows not refreshed for ``age_s`` seconds; returns how many."""
        return self._transaction(_forget_silent, age_s)

    def list_processes(self) -> list[ProcessInfo]:
        """Every registered process."""
        return [rows.process_info(r) for r in self._query("list_processes")]


def _forget_silent(tx: Tx, age_s: float) -> int:
    return tx.count("forget_silent_processes", {"age_s": age_s})
