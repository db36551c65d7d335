"""The worker's built-in hooks (:mod:`flowforge.roles.hooks`): telemetry, the task log lines,
time limits and recycling. Each is one concern; the worker registers all four."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable, Sequence
from uuid import UUID

from flowforge.config import ProcessesConfig
from flowforge.domain.model import Claim, Finish
from flowforge.domain.states import TaskState
from flowforge.roles import tasklog
from flowforge.roles.execution import timeout_finish
from flowforge.roles.hooks import WORKER_LOGGER, Hook, Recycle
from flowforge.telemetry import Telemetry

logger = logging.getLogger(WORKER_LOGGER)

#: Recycling jitter: up to this fraction is added to max_tasks_per_child.
RECYCLE_JITTER = 0.1


class Metrics(Hook):
    """Counters and histograms of started, finished and stale tasks (``flowforge.telemetry``)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._t = telemetry

    def after_claim(self, claims: Sequence[Claim]) -> None:
        for claim in claims:
            self._t.tasks_started.inc()
            self._t.dispatch_lag.observe(claim.dispatch_lag_s)

    def after_execute(self, claim: Claim, finish: Finish, duration_s: float) -> None:
        self._t.task_duration.labels(handler=claim.handler).observe(duration_s)

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        t = self._t
        for claim, finish in outcomes:
            if claim.task_run_id not in committed:
                t.stale_completions.inc()
            elif finish.state is TaskState.SUCCEEDED:
                t.tasks_succeeded.inc()
            elif finish.state is TaskState.CANCELLED:
                t.tasks_cancelled.inc()
            else:
                t.tasks_failed.labels(reason=str(finish.reason)).inc()


class TaskLog(Hook):
    """A line per attempt that ended otherwise than in success, and per stale completion
    (:mod:`flowforge.roles.tasklog`); none per success."""

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        for claim, finish in outcomes:
            if claim.task_run_id not in committed:
                logger.warning(
                    "stale completion of task run %s rejected (token %d is no longer current)",
                    claim.task_run_id,
                    claim.fencing_token,
                    extra={"action": "stale_completion"},
                )
            elif finish.state is not TaskState.SUCCEEDED:
                tasklog.attempt_ended(logger, claim, finish)


class TimeLimit(Hook):
    """A handler past its task's ``timeout`` is given up: FAILED with reason ``timeout``."""

    def while_running(self, claim: Claim, elapsed_s: float) -> float | Finish | None:
        timeout_s = claim.timeout_s
        if timeout_s is None:
            return None
        if elapsed_s < timeout_s:
            return timeout_s - elapsed_s
        logger.error(
            "task run %s overran its timeout; a sync handler's worker will be replaced",
            claim.task_run_id,
            extra={"action": "task_timeout"},
        )
        return timeout_finish(timeout_s)


class Recycling(Hook):
    """Replace the worker after ``max_tasks_per_child`` tasks (plus up to
    :data:`RECYCLE_JITTER`, so workers started together do not recycle together) or once its
    peak RSS passed ``max_memory_mb_per_child``; ``done`` counts the tasks finished."""

    def __init__(self, config: ProcessesConfig, recycle: Recycle, rand: Callable[[], float]):
        limit = config.max_tasks_per_child
        self._task_limit = limit + int(limit * RECYCLE_JITTER * rand()) if limit else 0
        self._memory_mb = config.max_memory_mb_per_child
        self._recycle = recycle
        self.done = 0

    def room(self, finishing: int) -> int | None:
        return self._task_limit - self.done - finishing if self._task_limit else None

    def after_finish(
        self, outcomes: Sequence[tuple[Claim, Finish]], committed: frozenset[UUID]
    ) -> None:
        self.done += len(outcomes)
        # after each commit too, not only after a batch: one rolling on for long (async
        # calls) asks for nothing more once the worker must go (Worker._take_more)
        self._check_memory()

    def after_batch(self, slow: bool) -> None:
        if self._task_limit and self.done >= self._task_limit:
            logger.info("recycling after %d task(s)", self.done, extra={"action": "recycle"})
            self._recycle.ask()
        self._check_memory()

    def _check_memory(self) -> None:
        if not self._memory_mb or self._recycle.asked:
            return
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        if peak_mb > self._memory_mb:
            logger.info("recycling at %.0f MB", peak_mb, extra={"action": "recycle"})
            self._recycle.ask()
