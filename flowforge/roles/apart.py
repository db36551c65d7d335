"""Finishing a batch task by task when its one statement failed for a reason not an outage.

A worker finishes a batch of tasks in one statement. Every value in it has been checked
(:mod:`flowforge.domain.values`), but should PostgreSQL still refuse one (a value the checks
missed, a constraint), the whole statement fails and with it the other tasks' outcomes. Then
each task is finished in its own statement, so only the culprit is affected; the culprit's
finish is retried as a failure whose text can always be stored (``unserializable_result`` with
the database's message, not retried), so it neither stays RUNNING until its lease lapses nor
makes the worker exit, and the batch's other tasks never run again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from uuid import UUID

from flowforge.domain.model import Claim, Finish, Finished
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import MAX_ERROR_CHARS, clean_text
from flowforge.errors import (
    DatabaseUnavailableError,
    StoreError,
    TransactionConflictError,
    UnstorableValueError,
)

logger = logging.getLogger(__name__)

#: Errors of a finish statement that say nothing about the values in it: the database is away
#: (the ledger retries the statement as it is) or a transaction kept losing a race (the
#: ``Database`` ran it again already; it propagates). Never a reason to finish apart.
NOT_THE_CONTENT = (DatabaseUnavailableError, TransactionConflictError)
#: What a finish statement raises when it is its content that is refused.
REFUSALS = (StoreError, UnstorableValueError)

#: Commits (task run, token, finish) triples in one statement; None if it gave up (outage).
Commit = Callable[[Sequence[tuple[UUID, int, Finish]]], Finished | None]


def refused(exc: BaseException) -> bool:
    """True if a finish statement failed for its content, not for an outage or a conflict."""
    return isinstance(exc, REFUSALS) and not isinstance(exc, NOT_THE_CONTENT)


def finish_apart(outcomes: list[tuple[Claim, Finish]], commit: Commit) -> Finished:
    """Finish each of ``outcomes`` in its own statement through ``commit``.

    A finish refused again is replaced, in ``outcomes`` too, by a FAILED
    ``unserializable_result`` carrying the database's message, and logged once (WARNING) with
    its task run id. An outage still propagates (the caller's retry handles it).
    """
    committed: set[UUID] = set()
    ready: list[tuple[UUID, int]] = []
    for index, (claim, finish) in enumerate(outcomes):
        key = (claim.task_run_id, claim.fencing_token)
        try:
            done = commit([(*key, finish)])
        except REFUSALS as exc:
            if not refused(exc):
                raise
            logger.warning(
                "task run %s: PostgreSQL refused its outcome (%s); it is recorded as failed "
                "with reason %s",
                claim.task_run_id,
                clean_text(str(exc), 500).encode("unicode_escape").decode("ascii"),
                FailureReason.UNSERIALIZABLE_RESULT,
                extra={"action": "finish_refused"},
            )
            finish = Finish(
                TaskState.FAILED,
                reason=FailureReason.UNSERIALIZABLE_RESULT,
                error=clean_text(f"the task's outcome could not be stored: {exc}", MAX_ERROR_CHARS),
            )
            outcomes[index] = (claim, finish)
            done = _commit_failure(commit, claim, finish)
        if done is not None:
            committed |= done.committed
            ready.extend(done.ready)
    return Finished(frozenset(committed), tuple(ready))


def _commit_failure(commit: Commit, claim: Claim, finish: Finish) -> Finished | None:
    try:
        return commit([(claim.task_run_id, claim.fencing_token, finish)])
    except REFUSALS as exc:
        if not refused(exc):
            raise
        # Nothing of the handler's is left in it: the lease lapses and the reaper retries it.
        logger.error(
            "task run %s: even its failure could not be recorded (%s)",
            claim.task_run_id,
            exc,
            extra={"action": "finish_abandoned"},
        )
        return None
