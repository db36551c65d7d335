"""The bench's CPU probe (tests/harness/cpuprobe.py): per-process readings from /proc, what a
set of processes spent between two of them, and named groups found afresh at each reading."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.harness import cpuprobe

NO_SUCH_PID = 2**22 + 1  # above pid_max's default


def test_cpu_is_read_per_process_and_a_gone_process_is_left_out() -> None:
    me = os.getpid()
    readings = cpuprobe.cpu_seconds([me, NO_SUCH_PID])
    assert list(readings) == [me]
    assert readings[me] > 0  # this interpreter has run


def test_cpu_spent_counts_new_processes_whole_and_ended_ones_only_between_the_readings() -> None:
    before = {1: 2.0, 2: 5.0, 3: 1.0}  # 3, a child of 1, ends before the second reading
    # 4 started between them; 1 spent 0.5 and reaped 3, whose whole life (1.0 s, none of it
    # between the readings) is in 1's reaped-children time now
    after = {1: 2.0 + 0.5 + 1.0, 2: 7.0, 4: 0.25}
    assert cpuprobe.spent(before, after) == 0.5 + 2.0 + 0.25


def test_a_probe_answers_each_group_and_lists_its_pids_at_each_reading() -> None:
    listed: list[int] = []

    def later() -> list[int]:  # empty at the start, this process at the stop
        listed.append(1)
        return [os.getpid()] if len(listed) > 1 else []

    probe = cpuprobe.Probe({"me": lambda: [os.getpid()], "later": later, "none": lambda: []})
    probe.start()
    deadline = time.process_time() + 0.1  # burn two ticks' worth of CPU, bounded
    while time.process_time() < deadline:
        pass
    spent = probe.stop()
    assert set(spent) == {"me", "later", "none"}
    assert spent["me"] >= 0.05 and spent["none"] == 0.0
    assert spent["later"] >= spent["me"]  # listed only at the stop: counted whole


def test_backends_of_a_database_are_found_by_their_title(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    titles = {
        11: "postgres: 15/main: postgres bench_ab 127.0.0.1(5000) idle",
        12: "postgres: postgres bench_ab [local] idle in transaction",
        13: "postgres: 15/main: postgres other 127.0.0.1(5001) idle",
        14: "postgres: 15/main: walwriter",
        15: "/usr/lib/postgresql/15/bin/postgres -D /var/lib/postgresql/15/main",
    }
    for pid, text in titles.items():
        (tmp_path / str(pid)).write_bytes(text.replace(" ", "\0").encode())
    real = Path

    def fake(path: str) -> Path:
        return tmp_path / path.split("/")[2] if path.startswith("/proc/") else real(path)

    monkeypatch.setattr(cpuprobe, "service_pids", lambda: {"postgresql": [*titles, 16]})
    monkeypatch.setattr(cpuprobe, "Path", fake)
    assert cpuprobe.backends("bench_ab") == [11, 12]
