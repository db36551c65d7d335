"""How the scheduler paces the retention purge (docs/operations.md "Retention and `flowforge
purge`"): a pure policy, given the clock and what each batch did; the scheduler runs the batches.

Caught up, the purge runs once per housekeeping interval, as before. Behind — a batch deleted as
many rows as it was allowed, so more are due — it runs again after a pause long enough that
purging takes at most ``share`` of the wall time, not one batch a minute (a million finished
runs due at once, 500 a minute, took more than a day). Each batch's size is steered towards
``batch_s`` seconds: long enough to be worth a transaction, short enough that the rows it locks
and the I/O it makes stay a small, steady cost to the tree's own work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The smallest and largest batch (rows of each kind a purge may delete in one transaction).
MIN_BATCH = 10
MAX_BATCH = 20_000
#: How far one batch's measure may move the next batch's size (a factor, either way): one slow
#: batch (a checkpoint, a vacuum) does not collapse the pace, nor one fast batch balloon it.
MAX_STEP = 2.0


@dataclass
class RetentionPacing:
    """When the next retention batch is due and how many rows it may delete.

    ``limit``: the first batch's size (the scheduler's ``batch_size``); ``interval_s``: the wait
    once caught up (``housekeeping_interval_s``); ``batch_s``: the seconds a batch aims to take;
    ``share``: the most of the wall time (0 to 1) purging may take while behind. Times are
    seconds of one monotonic clock.
    """

    limit: int
    interval_s: float
    batch_s: float
    share: float
    due_at: float = 0.0  # the first batch is due at once
    behind_purged: int = field(default=0)  # rows purged since the purge fell behind

    def due(self, now: float) -> bool:
        """Whether a batch is due at ``now``."""
        return now >= self.due_at

    def wait_s(self, now: float) -> float:
        """Seconds from ``now`` until the next batch is due (0 if it is)."""
        return max(0.0, self.due_at - now)

    def done(self, now: float, purged: int, elapsed_s: float) -> int | None:
        """Record a batch that ended at ``now``, took ``elapsed_s`` seconds and deleted
        ``purged`` rows (of every kind together). Returns the rows purged since the purge fell
        behind once it has caught up (``purged`` below the limit: no kind filled its batch),
        else None (more are due: the next batch comes after the pause)."""
        limit = self.limit
        self.behind_purged += purged
        if purged < limit:  # a partial batch says nothing of what a full one takes
            self.due_at = now + self.interval_s
            caught_up, self.behind_purged = self.behind_purged, 0
            return caught_up
        if elapsed_s > 0:
            steered = limit * self.batch_s / elapsed_s
            steered = min(limit * MAX_STEP, max(limit / MAX_STEP, steered))
            self.limit = int(min(MAX_BATCH, max(MIN_BATCH, steered)))
        self.due_at = now + elapsed_s * (1.0 - self.share) / self.share
        return None
