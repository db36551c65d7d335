"""Renewing the leases a worker holds, from its main thread, while handlers run."""

from __future__ import annotations

import logging
import time
from uuid import UUID

from flowforge.domain.model import Claim
from flowforge.errors import DatabaseUnavailableError
from flowforge.roles.context import TaskContext
from flowforge.store.repository import Repository

logger = logging.getLogger(__name__)

#: After a renewal failed for lack of a database, try again this soon (seconds).
RENEW_RETRY_S = 1.0


class Leases:
    """The claims a worker holds until their outcome commits, renewed together.

    Every ``heartbeat_s`` one statement extends all of them by ``lease_s``; a claim whose run
    was cancelled, or whose lease was lost (reaped, finished elsewhere), gets its
    ``ctx.cancelled`` set so a cooperative handler stops.
    """

    def __init__(self, repo: Repository, lease_s: float, heartbeat_s: float) -> None:
        self._repo = repo
        self._lease_s = lease_s
        self._heartbeat_s = heartbeat_s
        self._held: dict[UUID, tuple[Claim, TaskContext]] = {}
        self.renewed_at = time.monotonic()
        self._next_at = self.renewed_at + heartbeat_s

    def hold(self, claims: list[tuple[Claim, TaskContext]]) -> None:
        """Start holding freshly claimed tasks (their lease was just set by the claim)."""
        if not self._held:
            self.renewed_at = time.monotonic()
            self._next_at = self.renewed_at + self._heartbeat_s
        for claim, ctx in claims:
            self._held[claim.task_run_id] = (claim, ctx)

    def drop(self, task_run_ids: list[UUID]) -> None:
        for task_run_id in task_run_ids:
            self._held.pop(task_run_id, None)

    def due_in(self) -> float:
        """Seconds until the next renewal is due (0 when overdue)."""
        return max(0.0, self._next_at - time.monotonic())

    def maybe_renew(self) -> None:
        now = time.monotonic()
        if not self._held or now < self._next_at:
            return
        pairs = [(c.task_run_id, c.fencing_token) for c, _ in self._held.values()]
        try:
            held = self._repo.renew_leases(pairs, self._lease_s)
        except DatabaseUnavailableError as exc:
            logger.warning("lease renewal failed: %s", exc, extra={"action": "renew_failed"})
            self._next_at = now + RENEW_RETRY_S
            return
        self.renewed_at = now
        self._next_at = now + self._heartbeat_s
        for task_run_id, (_claim, ctx) in list(self._held.items()):
            if task_run_id not in held:
                self._held.pop(task_run_id)
                ctx.cancelled.set()
                logger.warning(
                    "lost the lease of task run %s (reaped or finished elsewhere); asking it "
                    "to stop",
                    task_run_id,
                    extra={"action": "lease_lost"},
                )
            elif held[task_run_id] and not ctx.cancelled.is_set():
                ctx.cancelled.set()
                logger.info(
                    "task run %s was asked to stop",
                    task_run_id,
                    extra={"action": "cancel_requested"},
                )

    def expired_locally(self) -> bool:
        """True once a full lease has passed since the last successful renewal."""
        return time.monotonic() - self.renewed_at > self._lease_s
