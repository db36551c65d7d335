"""The metrics the role processes count.

Under ``flowforge up`` every process of the tree writes its samples into the directory named by
``PROMETHEUS_MULTIPROC_DIR`` (set by ``flowforge/up.py`` before the first fork), one file per
kind and pid (``flowforge.samplefile``), so the api child's ``/metrics`` adds up the counters and
histograms of every worker, the scheduler and the publisher — including those of processes that
have since died. Without a directory the samples stay in memory. Nothing here imports
``prometheus_client``: only the api, which serves the text format, does.
"""

from __future__ import annotations

import bisect
import copy
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self, TypeVar

from flowforge.samplefile import SampleFile, sample_key

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds; prometheus_client's defaults, for handler durations.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
#: Seconds, for the dispatch lag and the scheduler's pass.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_K = TypeVar("_K", str, tuple[str, ...])


class Samples:
    """Where one process's samples go: files in ``directory``, or memory when it is None.

    Files are opened on first use and named after the pid that writes them; a fork after that
    starts new files in the child, whose counts are its own (:func:`_forget_files_after_fork`,
    so an increment does not ask the kernel for its pid each time).
    """

    def __init__(self, directory: str | None) -> None:
        self._directory = Path(directory) if directory else None
        self._lock = threading.Lock()
        self._files: dict[str, SampleFile] = {}
        self._memory: dict[str, float] = {}
        _LIVE.add(self)

    def forget_files(self) -> None:
        """In a forked child: the parent's open files are the parent's (and its lock may have
        been held by a thread the child does not have)."""
        self._lock = threading.Lock()
        self._files = {}

    def add(self, kind: str, key: str, amount: float) -> None:
        """Add ``amount`` to the sample ``key`` of a metric of type ``kind`` (counter/histogram)."""
        if self._directory is None:
            with self._lock:
                self._memory[key] = self._memory.get(key, 0.0) + amount
            return
        self._file(kind).add(key, amount)

    def value(self, kind: str, key: str) -> float:
        if self._directory is None:
            with self._lock:
                return self._memory.get(key, 0.0)
        return self._file(kind).value(key)

    def _file(self, kind: str) -> SampleFile:
        # The common case without the lock: a dict read is atomic (a fork empties the dict).
        sample_file = self._files.get(kind)
        if sample_file is not None:
            return sample_file
        return self._open(kind)

    def _open(self, kind: str) -> SampleFile:
        assert self._directory is not None
        with self._lock:
            sample_file = self._files.get(kind)
            if sample_file is None:
                path = self._directory / f"{kind}_{os.getpid()}.db"
                sample_file = self._files[kind] = SampleFile(path)
            return sample_file


#: Every Samples of this process, for :func:`_forget_files_after_fork`.
_LIVE: weakref.WeakSet[Samples] = weakref.WeakSet()


def _forget_files_after_fork() -> None:
    for samples in list(_LIVE):
        samples.forget_files()


os.register_at_fork(after_in_child=_forget_files_after_fork)


class _Metric:
    kind = ""

    def __init__(
        self,
        samples: Samples,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
    ) -> None:
        self._samples = samples
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._labels: tuple[tuple[str, str], ...] = ()
        self._children: dict[tuple[str, ...], Self] = {}
        self._lock = threading.Lock()
        if not self._labelnames:
            self._prepare()

    def labels(self, **values: str) -> Self:
        """The metric for these label values (every label name must be given)."""
        if set(values) != set(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {tuple(values)}")
        key = tuple(str(values[n]) for n in self._labelnames)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = copy.copy(self)
                child._labelnames = ()
                child._labels = tuple(zip(self._labelnames, key, strict=True))
                child._children = {}
                child._lock = threading.Lock()
                child._prepare()
                self._children[key] = child
            return child

    def _prepare(self) -> None:
        """Build the sample keys once (JSON: too slow per increment) and expose them at 0."""

    def _ready(self, keys: _K) -> _K:
        if self._labelnames:
            raise ValueError(f"{self._name} has labels {self._labelnames}: call labels() first")
        return keys

    def _key(self, suffix: str, extra: tuple[tuple[str, str], ...] = ()) -> str:
        return sample_key(
            self._name, self._name + suffix, dict(self._labels + extra), self._documentation
        )


class Counter(_Metric):
    """A count that only goes up (exposed as ``<name>_total``)."""

    kind = "counter"
    _total = ""

    def _prepare(self) -> None:
        self._total = self._key("_total")
        self._samples.add(self.kind, self._total, 0.0)

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self._samples.add(self.kind, self._ready(self._total), amount)

    def value(self) -> float:
        return self._samples.value(self.kind, self._ready(self._total))


class Histogram(_Metric):
    """Observations counted in buckets (upper bounds in the metric's unit; +Inf is added)."""

    kind = "histogram"

    def __init__(
        self,
        samples: Samples,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self._bounds = (*sorted(float(b) for b in buckets), math.inf)
        self._sum = ""
        self._buckets: tuple[str, ...] = ()
        super().__init__(samples, name, documentation, labelnames)

    def _prepare(self) -> None:
        self._sum = self._key("_sum")
        self._buckets = tuple(
            self._key("_bucket", (("le", "+Inf" if math.isinf(b) else repr(b)),))
            for b in self._bounds
        )
        for key in (self._sum, *self._buckets):  # every bucket is exposed, empty ones too
            self._samples.add(self.kind, key, 0.0)

    def observe(self, amount: float) -> None:
        self._samples.add(self.kind, self._ready(self._sum), amount)
        # Each observation lands in its own bucket only; the reader makes the counts cumulative.
        index = bisect.bisect_left(self._bounds, amount)
        self._samples.add(self.kind, self._buckets[index], 1.0)

    def count(self) -> float:
        return sum(self._samples.value(self.kind, k) for k in self._ready(self._buckets))

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the seconds the block took."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - start)


class Telemetry:
    """The metrics one process may touch; ``directory`` as for :class:`Samples`."""

    def __init__(self, directory: str | None = None) -> None:
        s = Samples(directory)
        self.tasks_started = Counter(
            s, "flowforge_tasks_started", "Task attempts whose handler started"
        )
        self.tasks_succeeded = Counter(s, "flowforge_tasks_succeeded", "Task runs that succeeded")
        self.tasks_failed = Counter(
            s, "flowforge_tasks_failed", "Failed attempts, by reason", ["reason"]
        )
        self.tasks_cancelled = Counter(
            s, "flowforge_tasks_cancelled", "Handlers that honoured a cancellation"
        )
        self.tasks_retried = Counter(
            s, "flowforge_tasks_retried", "Attempts scheduled for a retry, by reason", ["reason"]
        )
        self.tasks_dead = Counter(
            s, "flowforge_tasks_dead", "Task runs buried as DEAD, by reason", ["reason"]
        )
        self.stale_completions = Counter(
            s,
            "flowforge_stale_completions",
            "Finishes rejected because their fencing token was stale",
        )
        self.task_duration = Histogram(
            s, "flowforge_task_duration_seconds", "Handler wall time", ["handler"]
        )
        self.dispatch_lag = Histogram(
            s,
            "flowforge_dispatch_lag_seconds",
            "From READY (outbox row written) to the claim",
            buckets=LAG_BUCKETS,
        )
        self.scheduler_pass = Histogram(
            s,
            "flowforge_scheduler_pass_seconds",
            "Duration of one scheduler pass",
            buckets=LAG_BUCKETS,
        )
        self.reconnects = Counter(
            s, "flowforge_reconnects", "Connection losses a role recovered from", ["role"]
        )
        self.child_starts = Counter(
            s,
            "flowforge_child_starts",
            "Role process starts (restarts are starts beyond the desired count)",
            ["role"],
        )

    @classmethod
    def from_environment(cls) -> Telemetry:
        """Samples into ``$PROMETHEUS_MULTIPROC_DIR`` when it is set (``flowforge up`` sets it)."""
        return cls(os.environ.get(METRICS_DIR_ENV) or None)
