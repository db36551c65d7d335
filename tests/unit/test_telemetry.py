"""The roles' metric files, read back the way the api reads them (prometheus_client's collector).

The roles write prometheus_client's multiprocess layout themselves (``flowforge.samplefile``) so
that they never import prometheus_client; these tests pin that the api's collector reads what
they write: counters with and without labels, cumulative histogram buckets, several processes
added up, a file continued by a process that reuses a pid, and a file that outgrows its first
mapping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from flowforge.samplefile import INITIAL_SIZE, SampleFile, sample_key
from flowforge.telemetry import Counter, Histogram, Samples, Telemetry
from tests.helpers import modules_after_importing

Samples_ = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def collect(directory: Path) -> Samples_:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def test_counters_and_histograms_read_back_through_prometheus_client(tmp_path: Path) -> None:
    t = Telemetry(str(tmp_path))
    t.tasks_started.inc()
    t.tasks_started.inc(2)
    t.tasks_failed.labels(reason="timeout").inc()
    t.tasks_failed.labels(reason="timeout").inc()
    t.tasks_failed.labels(reason="lease_expired").inc()
    for seconds in (0.0005, 0.003, 0.003, 100.0):
        t.dispatch_lag.observe(seconds)
    with t.scheduler_pass.time():
        pass

    got = collect(tmp_path)
    assert got[("flowforge_tasks_started_total", ())] == 3
    assert got[("flowforge_tasks_failed_total", (("reason", "timeout"),))] == 2
    assert got[("flowforge_tasks_failed_total", (("reason", "lease_expired"),))] == 1
    lag = "flowforge_dispatch_lag_seconds"
    assert got[(f"{lag}_bucket", (("le", "0.001"),))] == 1
    assert got[(f"{lag}_bucket", (("le", "0.0025"),))] == 1  # an empty bucket is exposed too
    assert got[(f"{lag}_bucket", (("le", "0.005"),))] == 3  # cumulative
    assert got[(f"{lag}_bucket", (("le", "60.0"),))] == 3
    assert got[(f"{lag}_bucket", (("le", "+Inf"),))] == 4
    assert got[(f"{lag}_count", ())] == 4
    assert got[(f"{lag}_sum", ())] == pytest.approx(100.0065)
    assert got[("flowforge_scheduler_pass_seconds_count", ())] == 1
    assert t.dispatch_lag.count() == 4
    assert t.tasks_started.value() == 3


def test_the_files_of_several_processes_are_added_up(tmp_path: Path) -> None:
    t = Telemetry(str(tmp_path))
    t.tasks_succeeded.inc(5)
    pid = os.fork()
    if pid == 0:  # the same object after a fork writes the child's own file
        try:
            t.tasks_succeeded.inc(7)
            t.task_duration.labels(handler="h").observe(0.2)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    t.tasks_succeeded.inc()

    names = {p.name for p in tmp_path.iterdir()}
    assert names == {
        f"{kind}_{p}.db" for kind in ("counter", "histogram") for p in (os.getpid(), pid)
    }
    got = collect(tmp_path)
    assert got[("flowforge_tasks_succeeded_total", ())] == 13
    assert t.tasks_succeeded.value() == 6  # this process's own count
    assert got[("flowforge_task_duration_seconds_count", (("handler", "h"),))] == 1
    assert got[("flowforge_task_duration_seconds_bucket", (("handler", "h"), ("le", "0.25")))] == 1


def test_a_process_that_reuses_a_pid_continues_the_file(tmp_path: Path) -> None:
    path = tmp_path / "counter_1.db"
    key = sample_key("c", "c_total", {}, "help")
    first = SampleFile(path)
    first.add(key, 4)
    first.close()
    second = SampleFile(path)
    assert second.value(key) == 4
    second.add(key, 1)
    second.close()
    assert collect(tmp_path)[("c_total", ())] == 5


def test_a_file_grows_past_its_first_mapping(tmp_path: Path) -> None:
    samples = Samples(str(tmp_path))
    counter = Counter(samples, "flowforge_many", "many labels", ["n"])
    for n in range(2000):
        counter.labels(n=str(n)).inc(n)
    assert (tmp_path / f"counter_{os.getpid()}.db").stat().st_size > INITIAL_SIZE
    got = collect(tmp_path)
    assert len([k for k in got if k[0] == "flowforge_many_total"]) == 2000
    assert got[("flowforge_many_total", (("n", "1999"),))] == 1999
    assert counter.labels(n="0").value() == 0


def test_memory_samples_and_label_mistakes() -> None:
    t = Telemetry()  # no directory: counts stay in this process
    t.reconnects.labels(role="worker").inc()
    assert t.reconnects.labels(role="worker").value() == 1
    with pytest.raises(ValueError, match="call labels"):
        t.reconnects.inc()
    with pytest.raises(ValueError, match="takes labels"):
        t.reconnects.labels(kind="worker")
    with pytest.raises(ValueError, match="only goes up"):
        t.tasks_started.inc(-1)
    h = Histogram(Samples(None), "x_seconds", "x", buckets=(1, 2))
    h.observe(5)
    assert h.count() == 1


def test_the_roles_never_import_prometheus_client() -> None:
    """Only the api serves the text format; each other child saves ~2 MiB (docs/performance.md)."""
    roles = ("flowforge.boot", "flowforge.roles.worker", "flowforge.roles.scheduler")
    loaded = modules_after_importing("flowforge.up", *roles, "flowforge.roles.publisher")
    assert not {m for m in loaded if m.startswith("prometheus_client")}
