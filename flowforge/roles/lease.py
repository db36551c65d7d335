"""Renewing a claimed task's lease from the worker's main thread while its handler runs."""

from __future__ import annotations

import logging
import time

from flowforge.domain.model import Claim
from flowforge.errors import DatabaseUnavailableError
from flowforge.roles.context import TaskContext
from flowforge.store.repository import Repository

logger = logging.getLogger(__name__)

#: After a renewal failed for lack of a database, try again this soon (seconds).
RENEW_RETRY_S = 1.0


class LeaseKeeper:
    """Renews every ``heartbeat_s``; sets ``ctx.cancelled`` on a cancel request or a lost lease."""

    def __init__(
        self, repo: Repository, claim: Claim, ctx: TaskContext, lease_s: float, heartbeat_s: float
    ) -> None:
        self._repo = repo
        self._claim = claim
        self._ctx = ctx
        self._lease_s = lease_s
        self._heartbeat_s = heartbeat_s
        self.renewed_at = time.monotonic()
        self._next_at = self.renewed_at + heartbeat_s
        self.lost = False

    def due_in(self) -> float:
        """Seconds until the next renewal is due (0 when overdue)."""
        return max(0.0, self._next_at - time.monotonic())

    def maybe_renew(self) -> None:
        now = time.monotonic()
        if self.lost or now < self._next_at:
            return
        try:
            renewal = self._repo.renew_lease(
                self._claim.task_run_id, self._claim.fencing_token, self._lease_s
            )
        except DatabaseUnavailableError as exc:
            logger.warning("lease renewal failed: %s", exc, extra={"action": "renew_failed"})
            self._next_at = now + RENEW_RETRY_S
            return
        self.renewed_at = now
        self._next_at = now + self._heartbeat_s
        if not renewal.held:
            self.lost = True
            self._ctx.cancelled.set()
            logger.warning(
                "lost the lease of task run %s (reaped or finished elsewhere); asking it to stop",
                self._claim.task_run_id,
                extra={"action": "lease_lost"},
            )
        elif renewal.cancel_requested and not self._ctx.cancelled.is_set():
            self._ctx.cancelled.set()
            logger.info(
                "task run %s was asked to stop",
                self._claim.task_run_id,
                extra={"action": "cancel_requested"},
            )

    def expired_locally(self) -> bool:
        """True once a full lease has passed since the last successful renewal."""
        return time.monotonic() - self.renewed_at > self._lease_s
