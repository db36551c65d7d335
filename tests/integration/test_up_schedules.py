"""Schedules in real trees (``flowforge up``) on one database (SPEC 7.2), counted in PostgreSQL.

- Two trees firing an ``every: 1s`` schedule make exactly one decision (and at most one run)
  per fire time over several ticks, with no fire time left undecided.
- A tree SIGKILLed across several fire times catches up on restart per policy: ``catch_up:
  all`` runs every missed fire time, ``latest`` runs the newest and records the rest skipped.
- A tree whose clock is five hours ahead (``faketime``) changes nothing: fire times follow the
  database clock, alone and racing a tree with the right time.

Every wait polls the database or a log with a deadline; downtime is measured on the database
clock.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from tests.e2e import Stack
from tests.helpers import wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real trees

Sql = psycopg.Connection[tuple[Any, ...]]

FIRES_S = 60.0
SKEW = "+5h"
NOOP_MODULE = "tests.harness.bench_handlers"

WORKFLOW = {
    "name": "ticks",
    "tasks": [{"name": "only", "handler": "bench.noop"}],  # needs no database of its own
    "schedules": [
        {"every": "1s", "catch_up": "all", "overlap": "allow", "name": "every-all"},
        {"every": "1s", "catch_up": "latest", "overlap": "allow", "name": "every-latest"},
    ],
}


def config_for(stack: Stack, tmp_path: Path) -> Path:
    folder = tmp_path / "workflows"
    folder.mkdir(exist_ok=True)
    (folder / "ticks.yaml").write_text(yaml.safe_dump(WORKFLOW))
    return stack.config_path(
        handlers=[NOOP_MODULE],
        workflows=[str(folder)],
        processes={"workers": 1},
        scheduler={"poll_interval_s": 0.2},
    )


def db_now(sql: Sql) -> datetime:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def created_after(sql: Sql, schedule: str, after: datetime) -> int:
    row = sql.execute(
        "SELECT count(*) FROM schedule_fires WHERE schedule = %s AND outcome = 'created'"
        " AND NOT manual AND fire_time > %s",
        (schedule, after),
    ).fetchone()
    assert row is not None
    return int(row[0])


def wait_created(sql: Sql, schedule: str, after: datetime, n: int) -> None:
    wait_for(
        lambda: created_after(sql, schedule, after) >= n, FIRES_S, 0.1, f"{n} fires of {schedule}"
    )


def decisions(sql: Sql, schedule: str) -> Counter[tuple[datetime, str]]:
    """Every timetable fire time (spans expanded by the second) with its outcome, counted."""
    found: Counter[tuple[datetime, str]] = Counter()
    rows = sql.execute(
        "SELECT fire_time, coalesce(last_fire_time, fire_time), outcome, reason"
        " FROM schedule_fires WHERE schedule = %s AND NOT manual",
        (schedule,),
    ).fetchall()
    for first, last, outcome, reason in rows:
        at = first
        while at <= last:
            found[(at, outcome if reason is None else f"{outcome}/{reason}")] += 1
            at += timedelta(seconds=1)
    return found


def assert_each_fire_time_once(sql: Sql, schedule: str) -> Counter[str]:
    """Every second from the first decided fire time to the last is decided exactly once, and
    each created decision has exactly one run stamped with it; the outcomes, counted."""
    found = decisions(sql, schedule)
    times = sorted(at for at, _ in found)
    assert times, f"{schedule}: nothing was decided"
    assert all(n == 1 for n in found.values()), [k for k, n in found.items() if n > 1]
    seconds = int((times[-1] - times[0]).total_seconds()) + 1
    assert len(times) == len(set(times)) == seconds, "a fire time was decided twice or never"
    runs = sql.execute(
        "SELECT fire_time, count(*) FROM workflow_runs WHERE schedule = %s GROUP BY fire_time",
        (schedule,),
    ).fetchall()
    assert all(n == 1 for _, n in runs), [r for r in runs if r[1] > 1]
    assert sorted(at for at, _ in runs) == sorted(at for at, o in found if o == "created")
    late = sql.execute(
        "SELECT count(*) FROM schedule_fires WHERE schedule = %s AND fire_time > decided_at",
        (schedule,),
    ).fetchone()
    assert late == (0,), "a fire time was decided before it came, by the database clock"
    return Counter(outcome for _, outcome in found)


def test_two_trees_on_one_database_decide_each_fire_time_once(
    stack: Stack, tmp_path: Path, sql: Sql, trees: list[Tree]
) -> None:
    config = config_for(stack, tmp_path)
    trees += [Tree(config, tmp_path / "a.log"), Tree(config, tmp_path / "b.log")]
    for tree in trees:
        tree.ready()
    start = db_now(sql)
    wait_created(sql, "every-all", start, 6)
    for tree in trees:
        tree.stop()
    for schedule in ("every-all", "every-latest"):
        outcomes = assert_each_fire_time_once(sql, schedule)
        assert outcomes["created"] >= 6 or schedule == "every-latest", outcomes
    fired = [t.log().count("schedule every-all fired") for t in trees]
    assert sum(fired) == created_after(sql, "every-all", datetime.min.replace(tzinfo=start.tzinfo))


def test_a_tree_killed_across_fire_times_catches_up_per_policy(
    stack: Stack, tmp_path: Path, sql: Sql, trees: list[Tree]
) -> None:
    config = config_for(stack, tmp_path)
    first = Tree(config, tmp_path / "first.log")
    trees.append(first)
    first.ready()
    wait_created(sql, "every-all", db_now(sql), 2)
    first.kill()
    killed = db_now(sql)
    # five fire times pass with no scheduler (measured on the database clock)
    wait_for(lambda: db_now(sql) > killed + timedelta(seconds=5), 15, 0.1, "downtime")
    again = Tree(config, tmp_path / "again.log")
    trees.append(again)
    again.ready()
    wait_created(sql, "every-all", killed + timedelta(seconds=6), 2)
    wait_created(sql, "every-latest", killed + timedelta(seconds=6), 2)
    again.stop()
    everything = assert_each_fire_time_once(sql, "every-all")
    assert set(everything) == {"created"}, everything  # catch_up: all made up every one
    latest = assert_each_fire_time_once(sql, "every-latest")
    assert latest["skipped/catch_up"] >= 4, latest  # the downtime, recorded skipped


def test_a_tree_hours_ahead_changes_nothing(
    stack: Stack, tmp_path: Path, sql: Sql, trees: list[Tree]
) -> None:
    if shutil.which("faketime") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("faketime is missing: scripts/time-deps installs it")
        pytest.skip("faketime is missing (scripts/time-deps installs it)")
    config = config_for(stack, tmp_path)
    ahead = Tree(config, tmp_path / "ahead.log", prefix=("faketime", "-f", SKEW))
    trees.append(ahead)
    ahead.ready()
    start = db_now(sql)
    wait_created(sql, "every-all", start, 3)  # the skewed tree alone
    alone = sql.execute(
        "SELECT max(fire_time) FROM schedule_fires WHERE schedule = 'every-all'"
    ).fetchone()
    assert alone is not None and alone[0] <= db_now(sql)  # not five hours ahead
    right = Tree(config, tmp_path / "right.log")
    trees.append(right)
    right.ready()
    wait_created(sql, "every-all", db_now(sql), 4)  # both racing
    for tree in trees:
        tree.stop()
    for schedule in ("every-all", "every-latest"):
        assert_each_fire_time_once(sql, schedule)
    # the skewed tree did run five hours ahead: its log lines say so
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", re.MULTILINE)
    ahead_at = datetime.fromisoformat(stamp.findall(ahead.log())[-1])
    right_at = datetime.fromisoformat(stamp.findall(right.log())[-1])
    assert timedelta(hours=4) < ahead_at - right_at < timedelta(hours=6)
    assert "schedule every-all fired" in ahead.log()
