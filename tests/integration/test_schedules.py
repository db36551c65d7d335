"""Schedules against real PostgreSQL (SPEC 7.2), counting in the database.

Downtime is simulated by moving ``next_fire_at`` into the past (by the database clock), never
by waiting. Proven here:

- a due tick makes exactly one run however many ``Schedules`` parts race it;
- catch-up after downtime per policy (skip, latest, all bounded by max_catch_up), each
  skipped fire time recorded with why;
- overlap with an unfinished previous run per policy (allow, skip, cancel_previous);
- pause (no fires), resume (the paused span recorded, next fire in the future), trigger (a
  manual run that takes no timetable fire time);
- reload: an unchanged schedule keeps its next fire time, a changed one moves without deciding
  a fire time twice, a removed one is retired and never fired, a returning one is active again;
- runs carry ``schedule`` and ``fire_time``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.schedule import ScheduleDef
from flowforge.errors import NotFoundError, ScheduleRetiredError
from flowforge.roles.scheduler import Scheduler
from tests.helpers import race, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[object, ...]]


def workflow(*schedules: ScheduleDef, name: str = "nightly") -> WorkflowDef:
    return WorkflowDef(
        name=name,
        tasks=(TaskDef("first", "noop"), TaskDef("second", "noop", depends_on=("first",))),
        schedules=schedules,
    )


def synced(repo: Store, *flows: WorkflowDef) -> dict[str, WorkflowDef]:
    found = {w.name: w for w in flows}
    repo.sync(found)
    return found


def back(sql: Sql, name: str, expression: str) -> None:
    """Simulated downtime: the schedule's next fire time moved to ``expression`` (SQL, over
    now())."""
    sql.execute(f"UPDATE schedules SET next_fire_at = {expression} WHERE name = %s", (name,))


def fires(sql: Sql, name: str) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT outcome, reason, fire_time, last_fire_time, manual, run_id FROM schedule_fires"
        " WHERE schedule = %s ORDER BY fire_time, id",
        (name,),
    ).fetchall()


def runs_of(sql: Sql, name: str) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT id, fire_time, cancel_requested_at IS NOT NULL FROM workflow_runs"
        " WHERE schedule = %s ORDER BY fire_time",
        (name,),
    ).fetchall()


def db_now(sql: Sql) -> datetime:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[return-value]


def test_sync_adds_schedules_with_their_next_fire_time_on_the_database_clock(
    repo: Store, sql: Sql
) -> None:
    flow = workflow(ScheduleDef(every="1h"), ScheduleDef(cron="0 3 * * *", name="three-am"))
    result = repo.sync({flow.name: flow})
    assert result.added == ("nightly/0", "three-am")
    now = db_now(sql)
    listed = {s.name: s for s in repo.list_schedules()}
    hourly = listed["nightly/0"].next_fire_at
    assert hourly is not None and now < hourly <= now + timedelta(hours=1)
    assert hourly.minute == 0 and hourly.second == 0
    assert listed["three-am"].state == "active"
    assert listed["three-am"].spec["cron"] == "0 3 * * *"
    again = repo.sync({flow.name: flow})
    assert (again.added, again.changed, again.retired) == ((), (), ())


def test_a_due_tick_makes_one_run_stamped_with_schedule_and_fire_time(
    repo: Store, sql: Sql
) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1h", input={"region": "eu"})))
    back(sql, "nightly/0", "date_trunc('hour', now())")
    decided = repo.fire_due(flows, 100)
    assert [d.outcome for d in decided] == ["created"]
    (rid, fire_time, _), *rest = runs_of(sql, "nightly/0")
    assert rest == []
    assert fire_time == decided[0].fire_time
    run = repo.get_run(rid)  # type: ignore[arg-type]
    assert (run.schedule, run.fire_time, dict(run.input)) == (
        "nightly/0",
        fire_time,
        {"region": "eu"},
    )
    assert [t.name for t in run.tasks] == ["first", "second"]
    info = repo.get_schedule("nightly/0")
    assert info.last_run_id == rid and info.last_fire_at == fire_time
    assert info.next_fire_at == fire_time + timedelta(hours=1)  # type: ignore[operator]
    assert info.last_decision is not None and info.last_decision.outcome == "created"
    assert repo.fire_due(flows, 100) == []  # nothing due any more


def test_racing_schedulers_make_one_run_per_fire_time(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    flows = synced(
        repo,
        workflow(ScheduleDef(every="1m", catch_up="all", overlap="allow")),
    )
    back(sql, "nightly/0", "date_trunc('minute', now()) - interval '4 minutes'")

    def scheduler(own: Store) -> int:
        return sum(d.outcome == "created" for _ in range(5) for d in own.fire_due(flows, 100))

    created = sum(race(clean_database_url, *[scheduler] * 6))
    times = sorted(fire_time for _, fire_time, _ in runs_of(sql, "nightly/0"))
    # the five fire times, once each — six when the minute turned during the race (the sixth
    # is then due as well): every one made once, none skipped
    assert created == len(times) == len(set(times)) and len(times) in (5, 6)
    assert [later - earlier for earlier, later in itertools.pairwise(times)] == [
        timedelta(minutes=1)
    ] * (len(times) - 1)
    assert [f[0] for f in fires(sql, "nightly/0")] == ["created"] * len(times)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("latest", ["skipped catch_up 10", "created"]),
        ("all", ["skipped max_catch_up 8", "created", "created", "created"]),
    ],
)
def test_catch_up_after_downtime_follows_the_policy(
    repo: Store, sql: Sql, policy: str, expected: list[str]
) -> None:
    flows = synced(
        repo,
        workflow(ScheduleDef(every="1m", catch_up=policy, max_catch_up=3, overlap="allow")),
    )
    back(sql, "nightly/0", "date_trunc('minute', now()) - interval '10 minutes'")
    repo.fire_due(flows, 100)
    seen = []
    for outcome, reason, first, last, _, _ in fires(sql, "nightly/0"):
        if outcome == "skipped":  # a span: how many minutes it covers
            seen.append(f"skipped {reason} {int((last - first).total_seconds() // 60) + 1}")
        else:
            seen.append(outcome)
    assert seen == expected
    assert len(runs_of(sql, "nightly/0")) == expected.count("created")


def test_catch_up_skip_fires_nothing_that_is_long_overdue(repo: Store, sql: Sql) -> None:
    flows = synced(repo, workflow(ScheduleDef(cron="@yearly", catch_up="skip")))
    back(sql, "nightly/0", "date_trunc('year', now()) - interval '1 year'")
    repo.fire_due(flows, 100)
    assert runs_of(sql, "nightly/0") == []
    [(outcome, reason, first, last, _, _)] = fires(sql, "nightly/0")
    assert (outcome, reason) == ("skipped", "catch_up")
    assert last - first == first.replace(year=first.year + 1) - first
    info = repo.get_schedule("nightly/0")
    assert info.next_fire_at is not None and info.next_fire_at > db_now(sql)


@pytest.mark.parametrize(
    ("overlap", "created", "skipped", "cancelled"),
    [("allow", 3, 0, 0), ("skip", 1, 2, 0), ("cancel_previous", 3, 0, 2)],
)
def test_overlap_with_an_unfinished_previous_run_follows_the_policy(
    repo: Store, sql: Sql, overlap: str, created: int, skipped: int, cancelled: int
) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1m", catch_up="all", overlap=overlap)))
    back(sql, "nightly/0", "date_trunc('minute', now()) - interval '2 minutes'")
    repo.fire_due(flows, 100)  # three fire times; each run is unfinished (nothing executes)
    outcomes = [(f[0], f[1]) for f in fires(sql, "nightly/0")]
    assert outcomes.count(("created", None)) == created
    assert outcomes.count(("skipped", "overlap")) == skipped
    made = runs_of(sql, "nightly/0")
    assert len(made) == created
    assert sum(asked for _, _, asked in made) == cancelled
    if cancelled:  # the newest survives; the older ones had their tasks cancelled
        assert not made[-1][2]
        states = sql.execute(
            "SELECT DISTINCT t.state FROM task_runs t WHERE t.run_id = %s", (made[0][0],)
        ).fetchall()
        assert states == [("CANCELLED",)]


def test_an_unfinished_run_of_an_earlier_pass_is_the_previous_run(repo: Store, sql: Sql) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1s", overlap="skip")))

    def next_decision() -> str:
        decided = wait_for(lambda: repo.fire_due(flows, 100), timeout=5, what="a due tick")
        return " ".join(f"{d.outcome}{'/' + d.reason if d.reason else ''}" for d in decided)

    assert next_decision() == "created"
    assert next_decision() == "skipped/overlap"  # the first run has not finished
    sql.execute("UPDATE workflow_runs SET state = 'SUCCEEDED', finished_at = now()")
    assert next_decision() == "created"
    assert len(runs_of(sql, "nightly/0")) == 2


def test_pause_stops_fires_and_resume_records_what_passed_meanwhile(repo: Store, sql: Sql) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1m")))
    paused = repo.pause_schedule("nightly/0")
    assert paused.state == "paused" and paused.paused_at is not None
    assert repo.pause_schedule("nightly/0").state == "paused"  # twice: no change, no error
    back(sql, "nightly/0", "date_trunc('minute', now()) - interval '5 minutes'")
    assert repo.fire_due(flows, 100) == []
    assert runs_of(sql, "nightly/0") == []
    resumed = repo.resume_schedule("nightly/0")
    assert resumed.state == "active"
    assert resumed.next_fire_at is not None and resumed.next_fire_at > db_now(sql)
    [(outcome, reason, first, last, _, _)] = fires(sql, "nightly/0")
    assert (outcome, reason) == ("skipped", "paused")
    assert last - first >= timedelta(minutes=5)
    assert repo.fire_due(flows, 100) == []
    assert repo.resume_schedule("nightly/0").state == "active"  # twice: no change


def test_trigger_makes_a_manual_run_outside_the_timetable(repo: Store, sql: Sql) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1h", input={"n": 1})))
    repo.pause_schedule("nightly/0")  # a paused schedule can still be run by hand
    fired = repo.trigger_schedule("nightly/0", flows)
    run = repo.get_run(fired.run_id)
    assert (run.schedule, run.fire_time, dict(run.input)) == (
        "nightly/0",
        fired.fire_time,
        {"n": 1},
    )
    [(outcome, _, fire_time, _, manual, run_id)] = fires(sql, "nightly/0")
    assert (outcome, manual, run_id, fire_time) == ("created", True, fired.run_id, fired.fire_time)
    info = repo.get_schedule("nightly/0")
    assert info.last_run_id == fired.run_id and info.last_fire_at is None
    # a timetable fire at the same instant is its own decision
    back(sql, "nightly/0", "date_trunc('hour', now())")
    repo.resume_schedule("nightly/0")
    assert len(runs_of(sql, "nightly/0")) == 1


def test_operator_actions_refuse_unknown_and_retired_schedules(repo: Store) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1h")))
    for act in (repo.pause_schedule, repo.resume_schedule, repo.get_schedule):
        with pytest.raises(NotFoundError):
            act("nightly/7")
    with pytest.raises(NotFoundError):
        repo.trigger_schedule("nope", flows)
    repo.sync({"nightly": workflow()})
    for action in (repo.pause_schedule, repo.resume_schedule):
        with pytest.raises(ScheduleRetiredError):
            action("nightly/0")
    with pytest.raises(ScheduleRetiredError):
        repo.trigger_schedule("nightly/0", flows)


def test_reload_moves_changed_schedules_without_deciding_a_fire_time_twice(
    repo: Store, sql: Sql
) -> None:
    first = workflow(ScheduleDef(every="1m"), ScheduleDef(every="1h", name="hourly"))
    flows = synced(repo, first)
    back(sql, "nightly/0", "date_trunc('minute', now()) - interval '3 minutes'")
    before = repo.get_schedule("nightly/0").next_fire_at
    # the input changes: same timetable, same next fire time (the overdue ones still catch up)
    changed = workflow(
        ScheduleDef(every="1m", input={"v": 2}), ScheduleDef(every="1h", name="hourly")
    )
    result = repo.sync({"nightly": changed})
    assert result.changed == ("nightly/0",)
    assert repo.get_schedule("nightly/0").next_fire_at == before
    repo.fire_due({"nightly": changed}, 100)
    [(rid, _, _)] = runs_of(sql, "nightly/0")
    assert dict(repo.get_run(rid).input) == {"v": 2}  # type: ignore[arg-type]
    # the interval changes: the first fire time of the new spec after the last decided one
    decided = repo.get_schedule("nightly/0")
    slower = workflow(ScheduleDef(every="2m"), ScheduleDef(every="1h", name="hourly"))
    repo.sync({"nightly": slower})
    moved = repo.get_schedule("nightly/0").next_fire_at
    assert moved is not None and decided.next_fire_at is not None
    assert moved >= decided.next_fire_at and moved.minute % 2 == 0
    # removed: retired, never fired, kept with its history; back again: active
    result = repo.sync({"nightly": workflow(ScheduleDef(every="2m"))})
    assert result.retired == ("hourly",)
    back(sql, "hourly", "date_trunc('hour', now())")
    assert all(d.schedule != "hourly" for d in repo.fire_due(flows, 100))
    assert repo.get_schedule("hourly").state == "retired"
    result = repo.sync({"nightly": first})
    assert "hourly" in result.added
    assert repo.get_schedule("hourly").state == "active"
    assert len(runs_of(sql, "hourly")) == 0


def test_schedules_of_workflows_a_scheduler_does_not_load_are_left_alone(
    repo: Store, sql: Sql
) -> None:
    synced(repo, workflow(ScheduleDef(every="1h"), name="theirs"))
    mine = synced(repo, workflow(ScheduleDef(every="1h"), name="mine"))
    back(sql, "theirs/0", "date_trunc('hour', now())")
    assert repo.fire_due(mine, 100) == []
    assert repo.get_schedule("theirs/0").state == "active"


def test_a_pass_is_bounded_by_its_batch(repo: Store, sql: Sql) -> None:
    flows = synced(repo, *(workflow(ScheduleDef(every="1h"), name=f"w{i}") for i in range(5)))
    sql.execute("UPDATE schedules SET next_fire_at = date_trunc('hour', now())")
    counts = []
    fire: Callable[[], list[Any]] = lambda: repo.fire_due(flows, 2)  # noqa: E731
    while decided := fire():
        counts.append(len(decided))
    assert counts == [2, 2, 1]
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (5,)


def test_the_scheduler_role_syncs_at_initialize_fires_in_its_pass_and_reloads(
    sql: Sql, clean_database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flows = tmp_path / "workflows"
    flows.mkdir()
    (flows / "w.yaml").write_text(
        "name: w\ntasks: [{name: t, handler: h}]\n"
        "schedules:\n  - every: 1h\n  - every: 1m\n    name: minutely\n"
    )
    (flows / "broken.yaml").write_text("name: broken\ntasks: []\n")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"database: {{url: '{clean_database_url}'}}\nworkflows: ['{flows}']\n")
    scheduler = Scheduler(load_config(config_file, env={}))
    with caplog.at_level(logging.INFO, logger="flowforge.roles.scheduler"):
        scheduler.initialize()
        try:
            back(sql, "w/0", "date_trunc('hour', now())")
            assert scheduler.run_pass().fired == 1
            assert scheduler.run_pass().fired == 0
            # reload (what SIGHUP's rolling restart does): w/0 changed, minutely removed
            (flows / "w.yaml").write_text(
                "name: w\ntasks: [{name: t, handler: h}]\nschedules:\n  - every: 2h\n"
            )
            scheduler.reset()
            scheduler.initialize()
        finally:
            scheduler.shutdown()
    messages = [r.getMessage() for r in caplog.records]
    assert any("workflow file problem" in m and "broken.yaml" in m for m in messages)
    assert "schedules synced: 2 added, 0 changed, 0 retired (minutely, w/0)" in messages
    assert "schedules synced: 0 added, 1 changed, 1 retired (w/0, minutely)" in messages
    assert any(m.startswith("schedule w/0 fired ") for m in messages)
    assert len(runs_of(sql, "w/0")) == 1
    assert sql.execute(
        "SELECT retired_at IS NOT NULL FROM schedules WHERE name = 'minutely'"
    ).fetchone() == (True,)


def test_a_next_fire_time_moved_off_the_timetable_decides_nothing_and_realigns(
    repo: Store, sql: Sql
) -> None:
    flows = synced(repo, workflow(ScheduleDef(every="1h")))
    # a next fire time between two of the timetable's, already passed: nothing to decide
    back(sql, "nightly/0", "date_trunc('hour', now()) + (now() - date_trunc('hour', now())) / 2")
    repo.fire_due(flows, 100)
    assert fires(sql, "nightly/0") == [] and runs_of(sql, "nightly/0") == []
    info = repo.get_schedule("nightly/0")
    assert info.next_fire_at is not None and info.next_fire_at.minute == 0
    assert info.next_fire_at > db_now(sql)


def test_the_scheduler_sleeps_until_its_own_schedules_next_fire_time_and_no_longer(
    repo: Store, sql: Sql
) -> None:
    """The idle wait ends at the next fire time of a schedule this scheduler fires (by the
    database clock), so a schedule fires on time rather than within a poll interval; another
    tree's schedule, which it never fires, does not wake it (or it would spin on it)."""
    ours = synced(repo, workflow(ScheduleDef(every="1h"), name="ours"))
    synced(repo, workflow(ScheduleDef(every="1h"), name="theirs"))
    assert repo.next_due_s([]) is None
    back(sql, "theirs/0", "now() - interval '1 minute'")  # due, but not this scheduler's
    back(sql, "ours/0", "now() + interval '20 seconds'")
    due = repo.next_due_s(list(ours))
    assert due is not None and 18 < due <= 20
    repo.pause_schedule("ours/0")
    assert repo.next_due_s(list(ours)) is None  # a paused schedule wakes no one
