"""Schedules in the domain (flowforge/domain/schedule.py): fire times, DST, catch-up, overlap,
and every bad value a schedule can be given (in Python, in a file).

Instants are UTC; each DST case names the local wall times it is about.
"""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from flowforge.definitions import check_file, check_paths, workflow_from_mapping
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.schedule import (
    SKIP_GRACE_S,
    CatchUp,
    Decision,
    Overlap,
    ScheduleDef,
    ScheduleError,
    SkipReason,
    decide,
    paused_span,
)
from flowforge.errors import DefinitionError
from tests.helpers import modules_after_importing


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def fire_times(schedule: ScheduleDef, start: datetime, n: int) -> list[datetime]:
    found = []
    at: datetime | None = start
    for _ in range(n):
        assert at is not None
        at = schedule.next_after(at)
        assert at is not None
        found.append(at)
    return found


def local(times: list[datetime], zone: str) -> list[str]:
    return [t.astimezone(ZoneInfo(zone)).strftime("%m-%d %H:%M %Z") for t in times]


# ---------------------------------------------------------------- every: anchored on the epoch


def test_every_is_anchored_on_the_unix_epoch_so_every_tree_agrees() -> None:
    schedule = ScheduleDef(every="30s")
    assert schedule.next_after(utc(2026, 4, 1, 12, 0, 1)) == utc(2026, 4, 1, 12, 0, 30)
    assert schedule.next_after(utc(2026, 4, 1, 12, 0, 30)) == utc(2026, 4, 1, 12, 1, 0)
    seven = ScheduleDef(every="7m")  # not a divisor of an hour: still the epoch's multiples
    at = seven.next_after(utc(2026, 4, 1, 12, 0, 0))
    assert at is not None and (at - utc(1970, 1, 1)).total_seconds() % 420 == 0
    assert ScheduleDef(every="1d").next_after(utc(2026, 4, 1, 23, 59)) == utc(2026, 4, 2)


def test_every_ignores_daylight_saving_time() -> None:
    hourly = ScheduleDef(every="1h")
    # across Berlin's spring-forward and fall-back nights: exactly one hour apart, always
    for night in (utc(2026, 3, 28, 22), utc(2026, 10, 24, 22)):
        times = fire_times(hourly, night, 6)
        assert {b - a for a, b in itertools.pairwise(times)} == {timedelta(hours=1)}


def test_every_latest_at_or_before_and_at_or_after() -> None:
    schedule = ScheduleDef(every="5m")
    assert schedule.latest_at_or_before(utc(2026, 1, 1, 0, 9, 59)) == utc(2026, 1, 1, 0, 5)
    assert schedule.latest_at_or_before(utc(2026, 1, 1, 0, 10)) == utc(2026, 1, 1, 0, 10)
    assert schedule.at_or_after(utc(2026, 1, 1, 0, 10)) == utc(2026, 1, 1, 0, 10)


# ---------------------------------------------------------------- cron on the local wall clock


def test_cron_in_utc_and_the_aliases() -> None:
    start = utc(2026, 1, 1, 0, 0, 30)
    assert ScheduleDef(cron="*/15 * * * *").next_after(start) == utc(2026, 1, 1, 0, 15)
    expected = {
        "@hourly": utc(2026, 1, 1, 1),
        "@daily": utc(2026, 1, 2),
        "@midnight": utc(2026, 1, 2),
        "@weekly": utc(2026, 1, 4),  # the first Sunday
        "@monthly": utc(2026, 2, 1),
        "@yearly": utc(2027, 1, 1),
        "@annually": utc(2027, 1, 1),
    }
    for alias, at in expected.items():
        assert ScheduleDef(cron=alias).next_after(start) == at, alias
        assert ScheduleDef(cron=alias.upper()).next_after(start) == at, alias


def test_a_zone_without_dst_is_a_fixed_offset() -> None:
    tokyo = ScheduleDef(cron="0 9 * * *", timezone="Asia/Tokyo")
    times = fire_times(tokyo, utc(2026, 3, 1), 40)
    assert {(t.hour, t.minute) for t in times} == {(0, 0)}
    assert {b - a for a, b in itertools.pairwise(times)} == {timedelta(days=1)}


@pytest.mark.parametrize(
    ("zone", "cron", "start", "expected"),
    [
        # Berlin, 29 March 2026: 02:00 CET jumps to 03:00 CEST. 02:30 does not exist: once at 03:00
        (
            "Europe/Berlin",
            "30 2 * * *",
            utc(2026, 3, 27, 12),
            ["03-28 02:30 CET", "03-29 03:00 CEST", "03-30 02:30 CEST"],
        ),
        # several wall times of the gap fire once together, and 03:00 itself adds nothing
        (
            "Europe/Berlin",
            "*/20 * * * *",
            utc(2026, 3, 29, 0, 30),
            ["03-29 01:40 CET", "03-29 03:00 CEST", "03-29 03:20 CEST"],
        ),
        # New York, 8 March 2026: 02:00 EST jumps to 03:00 EDT
        (
            "America/New_York",
            "30 2 * * *",
            utc(2026, 3, 6, 12),
            ["03-07 02:30 EST", "03-08 03:00 EDT", "03-09 02:30 EDT"],
        ),
        # Lord Howe, 4 October 2026: 02:00 jumps to 02:30 (a 30-minute shift)
        (
            "Australia/Lord_Howe",
            "15 2 * * *",
            utc(2026, 10, 2, 12),
            ["10-03 02:15 +1030", "10-04 02:30 +11", "10-05 02:15 +11"],
        ),
    ],
)
def test_a_wall_time_that_does_not_exist_fires_once_at_the_next_valid_minute(
    zone: str, cron: str, start: datetime, expected: list[str]
) -> None:
    schedule = ScheduleDef(cron=cron, timezone=zone)
    assert local(fire_times(schedule, start, len(expected)), zone) == expected


@pytest.mark.parametrize(
    ("zone", "cron", "start", "expected"),
    [
        # Berlin, 25 October 2026: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice
        (
            "Europe/Berlin",
            "30 2 * * *",
            utc(2026, 10, 23, 12),
            ["10-24 02:30 CEST", "10-25 02:30 CEST", "10-26 02:30 CET"],
        ),
        # a cron every half hour: the repeated hour fires once (its first pass)
        (
            "Europe/Berlin",
            "*/30 * * * *",
            utc(2026, 10, 24, 23, 10),
            ["10-25 01:30 CEST", "10-25 02:00 CEST", "10-25 02:30 CEST", "10-25 03:00 CET"],
        ),
        # New York, 1 November 2026: 02:00 EDT falls back to 01:00 EST; 01:30 happens twice
        (
            "America/New_York",
            "30 1 * * *",
            utc(2026, 10, 30, 12),
            ["10-31 01:30 EDT", "11-01 01:30 EDT", "11-02 01:30 EST"],
        ),
        # Lord Howe, 5 April 2026: 02:00 falls back to 01:30; 01:45 happens twice
        (
            "Australia/Lord_Howe",
            "45 1 * * *",
            utc(2026, 4, 3, 12),
            ["04-04 01:45 +11", "04-05 01:45 +11", "04-06 01:45 +1030"],
        ),
    ],
)
def test_a_wall_time_that_occurs_twice_fires_once(
    zone: str, cron: str, start: datetime, expected: list[str]
) -> None:
    schedule = ScheduleDef(cron=cron, timezone=zone)
    assert local(fire_times(schedule, start, len(expected)), zone) == expected


@pytest.mark.parametrize(
    "zone", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "UTC", "Asia/Tokyo"]
)
@pytest.mark.parametrize("cron", ["*/7 * * * *", "15,45 1-3 * * *", "0 2 * * *"])
def test_fire_times_over_a_year_rise_and_agree_both_ways(zone: str, cron: str) -> None:
    """Across every DST change of 2026: each fire time is later than the one before, no local
    wall time fires twice, and the latest fire time at or before each is itself."""
    schedule = ScheduleDef(cron=cron, timezone=zone)
    tz = ZoneInfo(zone)
    changes = [
        d
        for d in (utc(2026, 1, 1) + timedelta(hours=h) for h in range(0, 365 * 24, 6))
        if d.astimezone(tz).utcoffset() != (d + timedelta(hours=6)).astimezone(tz).utcoffset()
    ] or [utc(2026, 6, 1)]
    for change in changes:
        times = fire_times(schedule, change - timedelta(hours=6), 60)
        assert times == sorted(set(times))
        walls = [t.astimezone(tz).replace(tzinfo=None) for t in times]
        assert len(walls) == len(set(walls))
        for at in times:
            assert schedule.latest_at_or_before(at) == at
            assert schedule.latest_at_or_before(at - timedelta(microseconds=1)) != at


def test_latest_at_or_before_in_the_second_pass_of_a_repeated_hour() -> None:
    schedule = ScheduleDef(cron="*/30 * * * *", timezone="Europe/Berlin")
    second_pass = utc(2026, 10, 25, 1, 40)  # 02:40 CET, after 02:00-02:59 CEST passed
    assert schedule.latest_at_or_before(second_pass) == utc(2026, 10, 25, 0, 30)  # 02:30 CEST


# ---------------------------------------------------------------- decisions


def test_a_fire_time_due_now_makes_one_run_and_the_next_follows() -> None:
    decision = decide(
        ScheduleDef(every="1m"), utc(2026, 1, 1, 0, 5), utc(2026, 1, 1, 0, 5, 0, 300), False
    )
    assert [(f.fire_time, f.created) for f in decision.fires] == [(utc(2026, 1, 1, 0, 5), True)]
    assert decision.next_fire_at == utc(2026, 1, 1, 0, 6)


@pytest.mark.parametrize(
    ("catch_up", "late_s", "fired", "skipped"),
    [
        ("latest", 3 * 3600, [utc(2026, 1, 1, 3)], (utc(2026, 1, 1, 0), utc(2026, 1, 1, 2))),
        (
            "all",
            3 * 3600,
            [utc(2026, 1, 1, h) for h in (1, 2, 3)],
            (utc(2026, 1, 1), utc(2026, 1, 1)),
        ),
        ("skip", 3 * 3600, [utc(2026, 1, 1, 3)], (utc(2026, 1, 1, 0), utc(2026, 1, 1, 2))),
        ("skip", 3 * 3600 + SKIP_GRACE_S + 1, [], (utc(2026, 1, 1, 0), utc(2026, 1, 1, 3))),
    ],
)
def test_catch_up_after_downtime(
    catch_up: str,
    late_s: float,
    fired: list[datetime],
    skipped: tuple[datetime, datetime],
) -> None:
    schedule = ScheduleDef(every="1h", catch_up=catch_up, max_catch_up=3, overlap="allow")
    start = utc(2026, 1, 1)
    decision = decide(schedule, start, start + timedelta(seconds=late_s), False)
    [span, *made] = decision.fires
    assert (span.created, span.fire_time, span.last_fire_time) == (False, *skipped)
    assert span.reason is (SkipReason.MAX_CATCH_UP if catch_up == "all" else SkipReason.CATCH_UP)
    assert [f.fire_time for f in made] == fired and all(f.created for f in made)
    assert decision.next_fire_at == utc(2026, 1, 1, 4)


def test_catch_up_all_within_its_bound_skips_nothing() -> None:
    schedule = ScheduleDef(every="1h", catch_up=CatchUp.ALL, overlap=Overlap.ALLOW)
    decision = decide(schedule, utc(2026, 1, 1), utc(2026, 1, 1, 2, 30), False)
    assert [(f.fire_time.hour, f.created) for f in decision.fires] == [
        (0, True),
        (1, True),
        (2, True),
    ]


@pytest.mark.parametrize(
    ("overlap", "previous", "expected"),
    [
        ("allow", True, ["run", "run", "run"]),
        ("skip", True, ["overlap", "overlap", "overlap"]),
        ("skip", False, ["run", "overlap", "overlap"]),
        ("cancel_previous", True, ["run+cancel", "run+cancel", "run+cancel"]),
        ("cancel_previous", False, ["run", "run+cancel", "run+cancel"]),
    ],
)
def test_overlap_is_judged_fire_by_fire(overlap: str, previous: bool, expected: list[str]) -> None:
    schedule = ScheduleDef(every="1h", catch_up="all", overlap=overlap)
    decision = decide(schedule, utc(2026, 1, 1), utc(2026, 1, 1, 2, 0, 5), previous)
    seen = [
        ("run+cancel" if f.cancel_previous else "run") if f.created else str(f.reason)
        for f in decision.fires
    ]
    assert seen == expected


def test_resume_skips_what_passed_while_paused() -> None:
    schedule = ScheduleDef(every="1m")
    span = paused_span(schedule, utc(2026, 1, 1), utc(2026, 1, 1, 0, 9, 30))
    assert span is not None and span.reason is SkipReason.PAUSED
    assert (span.fire_time, span.last_fire_time) == (utc(2026, 1, 1), utc(2026, 1, 1, 0, 9))
    assert paused_span(schedule, utc(2026, 1, 1, 0, 10), utc(2026, 1, 1, 0, 9, 30)) is None
    assert paused_span(schedule, None, utc(2026, 1, 1)) is None


# ---------------------------------------------------------------- definitions and bad input


def flow(*schedules: ScheduleDef) -> WorkflowDef:
    return WorkflowDef("w", (TaskDef("t", "h", idempotency_key="k-{region}"),), schedules=schedules)


def test_schedules_do_not_change_the_digest() -> None:
    bare = WorkflowDef("w", (TaskDef("t", "h"),))
    scheduled = WorkflowDef("w", (TaskDef("t", "h"),), schedules=(ScheduleDef(every="1s"),))
    assert scheduled.digest == bare.digest
    assert "schedules" not in scheduled.to_dict()


def test_names_default_to_workflow_and_index() -> None:
    workflow = flow(
        ScheduleDef(every="1h", input={"region": "eu"}),
        ScheduleDef(cron="@daily", input={"region": "us"}, name="daily-us"),
    )
    assert [n for n, _ in workflow.named_schedules()] == ["w/0", "daily-us"]


def test_the_spec_round_trips() -> None:
    schedule = ScheduleDef(
        cron="0 3 * * *",
        timezone="Europe/Berlin",
        input={"a": [1, "x"]},
        catch_up="all",
        max_catch_up=5,
        overlap="cancel_previous",
    )
    assert ScheduleDef.from_spec(schedule.to_spec()) == schedule


@pytest.mark.parametrize(
    ("fields", "key", "says"),
    [
        ({"cron": "61 * * * *"}, "cron", "bad minute"),
        ({"cron": "0 0 30 2 *"}, "cron", "bad day-of-month"),
        ({"cron": "0 24 * * *"}, "cron", "bad hour"),
        ({"cron": "* * * 13 *"}, "cron", "bad month"),
        ({"cron": "* * * *"}, "cron", "five fields"),
        ({"cron": "0 0 * * * *"}, "cron", "five fields"),
        ({"cron": "@sometimes"}, "cron", "five fields"),
        ({"cron": "0 3 * * *\x00"}, "cron", ""),
        ({"cron": 5}, "cron", "must be a string"),
        ({"cron": "@daily", "every": "1s"}, "cron", "exactly one"),
        ({}, "cron", "exactly one"),
        ({"every": "0s"}, "every", "longer than zero"),
        ({"every": "1.5s"}, "every", "not a duration"),
        ({"every": "999999999d"}, "every", "longer than a year"),
        ({"every": 30}, "every", "must be a duration"),
        ({"every": "1h", "timezone": "Europe/Berlin"}, "timezone", "cron only"),
        ({"cron": "@daily", "timezone": "Mars/Olympus"}, "timezone", "unknown time zone"),
        ({"cron": "@daily", "timezone": "../../etc/passwd"}, "timezone", "unknown time zone"),
        ({"cron": "@daily", "timezone": "Europe/Berlin\x00"}, "timezone", "not an IANA"),
        ({"cron": "@daily", "timezone": ""}, "timezone", "not an IANA"),
        ({"every": "1s", "catch_up": "sometimes"}, "catch_up", "skip, latest, all"),
        ({"every": "1s", "overlap": "never"}, "overlap", "allow, skip, cancel_previous"),
        ({"every": "1s", "max_catch_up": 0}, "max_catch_up", "from 1"),
        ({"every": "1s", "max_catch_up": 10**30}, "max_catch_up", "from 1"),
        ({"every": "1s", "max_catch_up": True}, "max_catch_up", "from 1"),
        ({"every": "1s", "name": "a/b"}, "name", "invalid"),
        ({"every": "1s", "input": {"x": math.nan}}, "input", "NaN"),
        ({"every": "1s", "input": {"x": "\x00"}}, "input", "NUL"),
        ({"every": "1s", "input": []}, "input", "mapping"),
    ],
)
def test_a_bad_schedule_names_its_field(fields: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ScheduleError) as raised:
        ScheduleDef(**fields)
    assert raised.value.key == key
    assert says.lower() in str(raised.value).lower()
    assert "\n" not in str(raised.value)


def test_duplicate_schedule_names_and_unrenderable_inputs_are_refused() -> None:
    twice = (ScheduleDef(every="1h", name="x"), ScheduleDef(every="1m", name="x"))
    with pytest.raises(ScheduleError, match=r"schedules\[1\]\.name: schedule name 'x' is used"):
        WorkflowDef("w", (TaskDef("t", "h"),), schedules=twice)
    # the task's key template needs {region}: a scheduled run could never be planned
    with pytest.raises(ScheduleError, match=r"schedules\[0\]\.input: .*region"):
        flow(ScheduleDef(every="1h"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_file_reports_each_bad_schedule_field_with_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path / "w.yaml",
        "name: w\n"
        "tasks: [{name: t, handler: h}]\n"
        "schedules:\n"
        "  - cron: '61 * * * *'\n"
        "  - every: 1s\n"
        "    timezone: Nowhere/Land\n"
        "  - every: 0s\n"
        "  - every: 1s\n"
        "    catch_up: sometimes\n"
        "    input: {a: 1}\n",
    )
    _, problems = check_file(path)
    assert problems == [
        f"{path}:4: schedules[0].cron: '61 * * * *': bad minute",
        f"{path}:6: schedules[1].timezone: "
        "applies to cron only: every is anchored on the Unix epoch in UTC",
        f"{path}:7: schedules[2].every: '0s' is not a duration: it must be longer than zero",
        f"{path}:9: schedules[3].catch_up: must be one of skip, latest, all, got 'sometimes'",
    ]


def test_a_file_refuses_an_input_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write(
        tmp_path / "w.yaml",
        "name: w\ntasks: [{name: t, handler: h}]\nschedules:\n  - every: 1s\n    input: [1]\n",
    )
    assert check_file(path)[1] == [f"{path}:5: schedules[0].input: expected a mapping, got a list"]


def test_schedule_names_are_unique_across_files(tmp_path: Path) -> None:
    write(
        tmp_path / "a.yaml",
        "name: a\ntasks: [{name: t, handler: h}]\nschedules: [{every: 1s, name: nightly}]\n",
    )
    b = write(
        tmp_path / "b.yaml",
        "name: b\ntasks: [{name: t, handler: h}]\nschedules: [{every: 1s, name: nightly}]\n",
    )
    found, problems = check_paths([tmp_path])
    assert list(found) == ["a"]
    assert problems == [f"{b}: schedule name 'nightly' is already used in {tmp_path / 'a.yaml'}"]


def test_python_and_yaml_build_the_same_schedules() -> None:
    from_yaml = workflow_from_mapping(
        {
            "name": "w",
            "tasks": [{"name": "t", "handler": "h"}],
            "schedules": [{"cron": "0 3 * * *", "timezone": "Europe/Berlin", "input": {"r": 1}}],
        }
    )
    in_python = WorkflowDef(
        "w",
        (TaskDef("t", "h"),),
        schedules=(ScheduleDef(cron="0 3 * * *", timezone="Europe/Berlin", input={"r": 1}),),
    )
    assert from_yaml == in_python


def test_a_definition_error_is_what_every_schedule_error_is() -> None:
    assert issubclass(ScheduleError, DefinitionError)
    assert str(ScheduleError("plain message")) == "plain message"


def test_a_next_fire_time_off_the_timetable_decides_nothing_until_the_next_one() -> None:
    hourly = ScheduleDef(every="1h")
    decision = decide(hourly, utc(2026, 1, 1, 10, 30), utc(2026, 1, 1, 10, 45), False)
    assert decision == Decision((), utc(2026, 1, 1, 11))
    dry = ScheduleDef(cron="0 0 29 2 *")  # leap days only: none between these two instants
    decision = decide(dry, utc(2026, 3, 1), utc(2026, 3, 2), False)
    assert decision.fires == () and decision.next_fire_at == utc(2028, 2, 29)


def test_the_supervisor_and_the_workers_load_no_cron_library() -> None:
    """They read no schedule, and every MiB they load is counted once per process: cronsim
    (with calendar and locale) is imported where a schedule is checked or computed
    (docs/performance.md, part 4's A/B). zoneinfo comes with psycopg's binary module anyway."""
    loaded = modules_after_importing(
        "flowforge.up", "flowforge.roles.worker", "flowforge.roles.publisher"
    )
    assert "flowforge.domain.schedule" in loaded  # through dag.py: the module, not its libraries
    assert not {m for m in loaded if m.split(".")[0] == "cronsim"}
