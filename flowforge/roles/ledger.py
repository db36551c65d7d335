"""The worker's statements: claim a batch, finish it, hand claims back — with their retries.

* A claim is one statement; it fails as it is (the role drops its connections, so the broker
  requeues the batch's deliveries, and reconnects).
* A finish is one statement, retried with backoff while the database is away — serving the
  broker meanwhile — until it commits or the leases have lapsed (the reaper then retries the
  tasks); it is never dropped silently. Should PostgreSQL refuse it for its content, its tasks
  are finished one by one so that only the culprit fails (:mod:`flowforge.roles.apart`).
  This is the only retry of an outage below ``run_role``; a conflict was already run again by
  the ``Database`` and propagates (``flowforge/roles/runner.py``, "Who retries a failed
  statement").
* A hand-back that cannot reach the database leaves the claims to their leases.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from uuid import UUID

from flowforge.config import Config
from flowforge.domain.model import Claim, ClaimOutcome, Continuation, Finish, Finished
from flowforge.errors import DatabaseUnavailableError
from flowforge.roles.apart import finish_apart, refused
from flowforge.roles.hooks import WORKER_LOGGER, Hooks
from flowforge.roles.lease import Leases
from flowforge.roles.runner import RECONNECT_BACKOFF
from flowforge.roles.seams import Pool, WorkerStore

logger = logging.getLogger(WORKER_LOGGER)

#: A failed finish is retried at least this many times before the lapsed leases give it up.
FINISH_ATTEMPTS_BEFORE_GIVING_UP = 3

#: Whether (and how many of) the dependents a finish releases it may claim for this worker,
#: given how many outcomes it finishes; None: none.
Then = Callable[[int], Continuation | None]


class Ledger:
    """Claims, finishes and hand-backs of one worker (``worker_id``) in PostgreSQL.

    ``beat`` is the role's liveness beat and ``serve`` serves the broker for N seconds: both
    run while a finish waits for the database to come back.
    """

    def __init__(
        self,
        config: Config,
        store: WorkerStore,
        db: Pool,
        leases: Leases,
        hooks: Hooks,
        serve: Callable[[float], None],
        beat: Callable[[], None],
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._config = config
        self._store = store
        self._db = db
        self._leases = leases
        self._hooks = hooks
        self._serve = serve
        self._beat = beat
        self._rand = rand
        self.worker_id = ""

    def claim(self, wanted: Sequence[tuple[UUID, int]], local: bool) -> list[Claim]:
        """Claim ``wanted`` in one statement; the claims to run (``local``: pairs this
        worker's own finish made READY, claimed without a message)."""
        worker = self._config.worker
        results = self._store.claim_many(
            wanted, self.worker_id, worker.lease_s, worker.key_wait_s, local=local
        )
        claims: list[Claim] = []
        for (task_run_id, _token), result in zip(wanted, results, strict=True):
            if result.outcome is ClaimOutcome.EXECUTE and result.claim is not None:
                claims.append(result.claim)
            else:
                logger.debug(
                    "task run %s not executed here: %s",
                    task_run_id,
                    result.outcome,
                    extra={"action": f"claim_{result.outcome}"},
                )
        return claims

    def finish(self, outcomes: list[tuple[Claim, Finish]], then: Then | None) -> Finished | None:
        """Commit ``outcomes`` in one statement (see module docstring); None if given up.

        With ``then`` the finish's transaction also claims dependents it releases. The leases
        are dropped with the commit and ``after_finish`` hooks hear of it (``outcomes``
        then holds the finishes as stored).
        """
        batch = [(c.task_run_id, c.fencing_token, f) for c, f in outcomes]
        try:
            finished = self._commit(batch, then)
        except Exception as exc:
            if not refused(exc):
                raise
            finished = finish_apart(outcomes, self._commit)
            # one whose failure could not be stored either is left to its lease to lapse
            self._leases.drop([c.task_run_id for c, _ in outcomes])
        if finished is not None:
            self._hooks.after_finish(outcomes, finished.committed)
        return finished

    def release(self, claims: Sequence[Claim]) -> int:
        """Hand back claims whose handlers never started; returns how many went back."""
        if not claims:
            return 0
        pairs = [(c.task_run_id, c.fencing_token) for c in claims]
        with self._leases.settling():
            try:
                released = self._store.release_claims(pairs)
            except DatabaseUnavailableError as exc:
                # Still ours until their leases lapse: then the reaper re-dispatches them.
                logger.warning(
                    "could not hand back %d claim(s): %s",
                    len(pairs),
                    exc,
                    extra={"action": "release_failed"},
                )
                released = 0
            self._leases.drop([task_run_id for task_run_id, _ in pairs])
        return released

    def _commit(
        self, batch: Sequence[tuple[UUID, int, Finish]], then: Then | None = None
    ) -> Finished | None:
        """Finish ``batch`` in one statement, retried while the database is away; None once
        the leases have lapsed meanwhile (given up: the reaper retries the tasks)."""
        failures = 0
        while True:
            # decided per attempt: serving the broker between retries may have found it broken
            continuation = then(len(batch)) if then is not None else None
            try:
                with self._leases.settling():
                    # only what one window can take comes back; the rest go out as messages
                    finished = self._store.finish_many(
                        batch,
                        offer=self._config.broker.prefetch,
                        then=continuation,
                        queue=self._config.broker.queue,
                        min_priority=self._config.worker.min_priority,
                    )
                    self._leases.drop([task_run_id for task_run_id, _, _ in batch])
                return finished
            except DatabaseUnavailableError as exc:
                failures += 1
                if self._leases.expired_locally() and failures > FINISH_ATTEMPTS_BEFORE_GIVING_UP:
                    logger.error(
                        "could not record the outcome of %d task run(s) before their leases "
                        "lapsed (%s); the reaper will retry them",
                        len(batch),
                        exc,
                        extra={"action": "finish_abandoned"},
                    )
                    self._leases.drop([task_run_id for task_run_id, _, _ in batch])
                    return None
                delay = RECONNECT_BACKOFF.delay(failures, self._rand)
                logger.warning(
                    "finish failed (%s); retrying in %.1fs",
                    exc,
                    delay,
                    extra={"action": "finish_retry"},
                )
                self._db.reset()
                self._beat()
                self._serve(delay)
