"""Prometheus metrics written by the role processes.

Under ``flowforge up`` every process of the tree shares ``PROMETHEUS_MULTIPROC_DIR`` (set by
``flowforge/up.py`` before the first fork), so the api child's ``/metrics`` adds up the
counters and histograms of every worker, the scheduler and the publisher — including those of
processes that have since died. Metric objects are created per process (``registry=None``):
nothing is registered globally at import time.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    """The metrics one process may touch."""

    def __init__(self) -> None:
        self.tasks_started = Counter(
            "flowforge_tasks_started", "Task attempts whose handler started", registry=None
        )
        self.tasks_succeeded = Counter(
            "flowforge_tasks_succeeded", "Task runs that succeeded", registry=None
        )
        self.tasks_failed = Counter(
            "flowforge_tasks_failed", "Failed attempts, by reason", ["reason"], registry=None
        )
        self.tasks_cancelled = Counter(
            "flowforge_tasks_cancelled", "Handlers that honoured a cancellation", registry=None
        )
        self.tasks_retried = Counter(
            "flowforge_tasks_retried",
            "Attempts scheduled for a retry, by reason",
            ["reason"],
            registry=None,
        )
        self.tasks_dead = Counter(
            "flowforge_tasks_dead", "Task runs buried as DEAD, by reason", ["reason"], registry=None
        )
        self.stale_completions = Counter(
            "flowforge_stale_completions",
            "Finishes rejected because their fencing token was stale",
            registry=None,
        )
        self.task_duration = Histogram(
            "flowforge_task_duration_seconds", "Handler wall time", ["handler"], registry=None
        )
        self.dispatch_lag = Histogram(
            "flowforge_dispatch_lag_seconds",
            "From READY (outbox row written) to the claim",
            buckets=LAG_BUCKETS,
            registry=None,
        )
        self.scheduler_pass = Histogram(
            "flowforge_scheduler_pass_seconds",
            "Duration of one scheduler pass",
            buckets=LAG_BUCKETS,
            registry=None,
        )
        self.reconnects = Counter(
            "flowforge_reconnects",
            "Connection losses a role recovered from",
            ["role"],
            registry=None,
        )
        self.child_starts = Counter(
            "flowforge_child_starts",
            "Role process starts (restarts are starts beyond the desired count)",
            ["role"],
            registry=None,
        )
