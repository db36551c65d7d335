"""Schedules (SPEC 7.2): when a workflow runs by itself, and what a scheduler pass decides.

Pure: no I/O and no clock. Every function takes the instant it calls "now" as an argument;
the store passes the database's ``now()`` (THE DATABASE CLOCK IS THE ONLY CLOCK).

Two kinds of timetable:

- ``cron:`` five fields (or an ``@hourly``-style alias) read on the wall clock of
  ``timezone``, parsed and iterated by cronsim on naive local times; this module maps each
  matching wall time to one instant. A wall time that does not exist (the hour skipped when
  daylight-saving time starts) fires once, at the first instant after the gap (the next valid
  minute); a wall time that occurs twice (the hour repeated when it ends) fires once, at its
  first occurrence. Several wall times of one gap fire once together.
- ``every:`` a fixed interval (``30s``, ``5m``, ``2h``, ``1d``; at least one second) anchored
  on the Unix epoch in UTC: the fire times are the instants whose epoch seconds are multiples
  of the interval, so every tree computes the same ones, whatever its zone or DST.

All instants are aware datetimes in UTC, whole seconds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from flowforge.domain.values import to_json
from flowforge.durations import parse_duration
from flowforge.errors import DefinitionError, UnstorableValueError

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

# cronsim (and zoneinfo) are imported where a schedule is checked or computed, not here: every
# process imports this module (through dag.py), and only the scheduler, the api and the CLI
# read schedules — the supervisor and the workers, whose memory counts once per process, do not.

#: ``cron:`` aliases and the five fields each stands for.
ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: Largest ``max_catch_up`` accepted (fire times made up after downtime, per pass).
MAX_CATCH_UP_LIMIT = 10_000
#: Longest ``every:`` (a year), in seconds.
MAX_EVERY_S = 366 * 86_400
#: ``catch_up: skip`` still fires a fire time at most this late (seconds): later, it was missed.
SKIP_GRACE_S = 60.0
#: A schedule name of its own (``name:``); the default, ``workflow/index``, has a slash.
SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)
#: Longest daylight-saving shift of any zone (Antarctica/Troll: 2 h), with room to spare.
_MAX_SHIFT = timedelta(hours=3)
#: cronsim gives up after 50 years without a match; so does :func:`next_after`.
_FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")


class CatchUp(StrEnum):
    """What a pass does with fire times that passed while no scheduler fired them."""

    SKIP = "skip"  # none, except the latest if it is at most SKIP_GRACE_S late
    LATEST = "latest"  # the latest one; the older ones are skipped
    ALL = "all"  # every one, oldest first, at most max_catch_up (the most recent)


class Overlap(StrEnum):
    """What a fire does while the schedule's previous run is still unfinished."""

    ALLOW = "allow"  # start another run beside it
    SKIP = "skip"  # record the fire time as skipped (reason overlap)
    CANCEL_PREVIOUS = "cancel_previous"  # cancel the previous run, then start the new one


class SkipReason(StrEnum):
    """Why a fire time made no run (stored with the decision)."""

    CATCH_UP = "catch_up"  # passed during downtime; the catch_up policy left it out
    MAX_CATCH_UP = "max_catch_up"  # catch_up: all, but older than the max_catch_up newest
    OVERLAP = "overlap"  # the previous run was unfinished and overlap is skip
    PAUSED = "paused"  # passed while the schedule was paused
    INVALID_INPUT = "invalid_input"  # the workflow refused the schedule's input


class ScheduleError(DefinitionError):
    """A schedule field is invalid; ``key`` names it (``cron``, ``timezone``, ...)."""

    def __init__(self, key: str, detail: str | None = None) -> None:
        if detail is None:  # a message alone, like any DefinitionError
            key, detail = "", key
        self.key = key
        self.detail = detail
        super().__init__(f"{key}: {detail}" if key else detail)


@dataclass(frozen=True)
class ScheduleDef:
    """One schedule of a workflow (``schedules:`` in its file). Exactly one of ``cron`` and
    ``every``; ``timezone`` applies to ``cron`` only; ``input`` is the run input."""

    cron: str | None = None
    every: str | None = None
    timezone: str = "UTC"
    input: Mapping[str, Any] = field(default_factory=dict, hash=False)
    catch_up: CatchUp = CatchUp.LATEST
    max_catch_up: int = 100
    overlap: Overlap = Overlap.SKIP
    name: str | None = None

    def __post_init__(self) -> None:
        self._check_timetable()
        self._check_policies()

    def _check_timetable(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise ScheduleError("cron", "give exactly one of cron and every")
        if self.cron is not None:
            _check_cron(self.cron)
            _zone(self.timezone)
            return
        self.interval_s  # noqa: B018 - validates
        if self.timezone != "UTC":
            raise ScheduleError(
                "timezone", "applies to cron only: every is anchored on the Unix epoch in UTC"
            )

    def _check_policies(self) -> None:
        if not isinstance(self.input, Mapping):
            raise ScheduleError("input", "must be a mapping")
        try:
            to_json(self.input, "the schedule input")
        except UnstorableValueError as exc:
            raise ScheduleError("input", str(exc)) from exc
        if not isinstance(self.catch_up, CatchUp):
            object.__setattr__(self, "catch_up", _enum(CatchUp, self.catch_up, "catch_up"))
        if not isinstance(self.overlap, Overlap):
            object.__setattr__(self, "overlap", _enum(Overlap, self.overlap, "overlap"))
        if (
            isinstance(self.max_catch_up, bool)
            or not isinstance(self.max_catch_up, int)
            or not 1 <= self.max_catch_up <= MAX_CATCH_UP_LIMIT
        ):
            raise ScheduleError(
                "max_catch_up", f"must be a whole number from 1 to {MAX_CATCH_UP_LIMIT}"
            )
        if self.name is not None and (
            not isinstance(self.name, str) or not SCHEDULE_NAME.fullmatch(self.name)
        ):
            raise ScheduleError(
                "name", f"{self.name!r} is invalid: use 1-128 letters, digits, '_', '.', '-'"
            )

    @property
    def interval_s(self) -> int | None:
        """``every`` in whole seconds (None for a cron schedule)."""
        if self.every is None:
            return None
        if not isinstance(self.every, str):
            raise ScheduleError("every", "must be a duration such as 30s, 5m, 2h or 1d")
        try:
            seconds = parse_duration(self.every)
        except ValueError as exc:
            raise ScheduleError("every", str(exc)) from None
        if seconds > MAX_EVERY_S:
            raise ScheduleError("every", f"{self.every!r} is longer than a year")
        return int(seconds)

    @property
    def expression(self) -> str | None:
        """The cron expression as five fields (an alias expanded); None for ``every``."""
        if self.cron is None:
            return None
        return ALIASES.get(self.cron.strip().lower(), self.cron.strip())

    def to_spec(self) -> dict[str, Any]:
        """The timetable and policies as stored (``schedules.spec``): everything but the name."""
        spec: dict[str, Any] = {"cron": self.cron} if self.cron is not None else {}
        if self.every is not None:
            spec["every"] = self.every
        spec.update(
            timezone=self.timezone,
            input=json.loads(to_json(self.input, "the schedule input")),
            catch_up=str(self.catch_up),
            max_catch_up=self.max_catch_up,
            overlap=str(self.overlap),
        )
        return spec

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], name: str | None = None) -> ScheduleDef:
        """The inverse of :meth:`to_spec`."""
        return cls(
            cron=spec.get("cron"),
            every=spec.get("every"),
            timezone=spec.get("timezone", "UTC"),
            input=spec.get("input", {}),
            catch_up=CatchUp(spec.get("catch_up", "latest")),
            max_catch_up=int(spec.get("max_catch_up", 100)),
            overlap=Overlap(spec.get("overlap", "skip")),
            name=name,
        )

    def describe(self) -> str:
        """``cron 0 3 * * * Europe/Berlin`` or ``every 30s``: what the lists show."""
        if self.cron is not None:
            return f"cron {self.cron}"
        return f"every {self.every}"

    def next_after(self, t: datetime) -> datetime | None:
        """The first fire time strictly after ``t`` (aware); None if there is none within
        50 years (a cron such as ``0 0 30 2 *`` is refused up front, but ``* * 31 4-6 1L``
        style rarities may still run dry)."""
        _aware(t)
        interval = self.interval_s
        if interval is not None:
            seconds = math.floor((t - _EPOCH).total_seconds() / interval) * interval + interval
            return _EPOCH + timedelta(seconds=seconds)
        zone = _zone(self.timezone)
        for wall in _walls(self._expression(), _wall(t, zone)):
            instant = _resolve(wall, zone)
            if instant > t:
                return instant
        return None

    def at_or_after(self, t: datetime) -> datetime | None:
        """The first fire time at ``t`` or later."""
        return self.next_after(t - _ONE_US)

    def latest_at_or_before(self, t: datetime) -> datetime | None:
        """The last fire time at ``t`` or earlier (None if none within 50 years)."""
        _aware(t)
        interval = self.interval_s
        if interval is not None:
            seconds = math.floor((t - _EPOCH).total_seconds() / interval) * interval
            return _EPOCH + timedelta(seconds=seconds)
        zone = _zone(self.timezone)
        local = t.astimezone(zone)
        # in the second pass of a repeated hour, later wall times still resolve to instants
        # before t (their first pass): start past the repeated hour
        start = _wall(t, zone) + (_MAX_SHIFT if local.fold else timedelta(0))
        for wall in _walls(self._expression(), start + timedelta(seconds=1), reverse=True):
            instant = _resolve(wall, zone)
            if instant <= t:
                return instant
        return None

    def _expression(self) -> str:
        expression = self.expression
        assert expression is not None
        return expression


@dataclass(frozen=True)
class Fire:
    """One decision about a fire time: ``created`` (a run is made) or skipped for ``reason``.

    A skipped span covers every fire time from ``fire_time`` to ``last_fire_time``;
    ``cancel_previous`` asks to cancel the schedule's previous run before this one starts."""

    fire_time: datetime
    created: bool
    reason: SkipReason | None = None
    last_fire_time: datetime | None = None
    cancel_previous: bool = False


@dataclass(frozen=True)
class Decision:
    """What one pass does with a due schedule: its fires, oldest first, and its next fire time
    (None: the timetable has run dry)."""

    fires: tuple[Fire, ...]
    next_fire_at: datetime | None


def decide(
    schedule: ScheduleDef, due: datetime, now: datetime, previous_unfinished: bool
) -> Decision:
    """The fires of a schedule whose next fire time ``due`` is at or before ``now``.

    ``previous_unfinished``: the schedule's last run has not finished. Catch-up picks which
    due fire times start runs (:class:`CatchUp`); overlap is then judged one fire at a time
    (a run just started is unfinished, so ``catch_up: all`` with ``overlap: skip`` starts one).
    """
    latest = schedule.latest_at_or_before(now)
    if latest is None or latest < due:
        # ``due`` is not one of this timetable's fire times (moved by hand, or written by other
        # code) and none lies between it and now: nothing to decide, wait for the next one
        return Decision((), schedule.at_or_after(due))
    wanted: list[datetime] = []
    if schedule.catch_up is CatchUp.ALL:
        cursor: datetime | None = latest
        while cursor is not None and cursor >= due and len(wanted) < schedule.max_catch_up:
            wanted.append(cursor)
            cursor = schedule.latest_at_or_before(cursor - _ONE_US)
        wanted.reverse()
    elif schedule.catch_up is CatchUp.LATEST or (now - latest).total_seconds() <= SKIP_GRACE_S:
        wanted.append(latest)
    fires: list[Fire] = []
    first = wanted[0] if wanted else None
    if first is None or first > due:
        end = schedule.latest_at_or_before((first or latest + _ONE_US) - _ONE_US)
        reason = (
            SkipReason.MAX_CATCH_UP if schedule.catch_up is CatchUp.ALL else SkipReason.CATCH_UP
        )
        fires.append(Fire(due, created=False, reason=reason, last_fire_time=end))
    running = previous_unfinished
    for fire_time in wanted:
        if running and schedule.overlap is Overlap.SKIP:
            fires.append(Fire(fire_time, created=False, reason=SkipReason.OVERLAP))
            continue
        cancel = running and schedule.overlap is Overlap.CANCEL_PREVIOUS
        fires.append(Fire(fire_time, created=True, cancel_previous=cancel))
        running = True
    return Decision(tuple(fires), schedule.next_after(now))


def paused_span(schedule: ScheduleDef, due: datetime | None, now: datetime) -> Fire | None:
    """On resume: the fire times from ``due`` to ``now`` that passed while paused, as one
    skipped span (None if none passed)."""
    if due is None or due > now:
        return None
    return Fire(
        due,
        created=False,
        reason=SkipReason.PAUSED,
        last_fire_time=schedule.latest_at_or_before(now),
    )


def default_name(workflow: str, index: int) -> str:
    """A schedule's name when it has no ``name:``: ``workflow/index`` (from 0)."""
    return f"{workflow}/{index}"


def _check_cron(cron: str) -> None:
    if not isinstance(cron, str):
        raise ScheduleError("cron", "must be a string of five fields or an alias")
    expression = ALIASES.get(cron.strip().lower(), cron.strip())
    fields = expression.split()
    if len(fields) != 5:
        aliases = ", ".join(sorted(ALIASES))
        raise ScheduleError(
            "cron", f"{cron!r} needs five fields (minute hour day month weekday) or {aliases}"
        )
    from cronsim import CronSim, CronSimError

    try:
        first = next(iter(CronSim(expression, datetime(2000, 1, 1))), None)
    except CronSimError as exc:
        raise ScheduleError("cron", f"{cron!r}: {str(exc).lower()}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # what cronsim does not catch itself
        raise ScheduleError("cron", f"{cron!r}: {exc}") from None
    if first is None:
        raise ScheduleError("cron", f"{cron!r} never fires")


def _zone(name: str) -> ZoneInfo:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not isinstance(name, str) or not name or "\x00" in name:
        raise ScheduleError("timezone", f"{name!r} is not an IANA time zone name")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(
            "timezone", f"unknown time zone {name!r} (an IANA name such as Europe/Berlin)"
        ) from None


def _enum(kind: type[CatchUp] | type[Overlap], value: Any, key: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m) for m in kind)
        raise ScheduleError(key, f"must be one of {allowed}, got {value!r}") from None


def _aware(t: datetime) -> None:
    if t.tzinfo is None:
        raise ValueError("an aware datetime is needed")


def _wall(t: datetime, zone: ZoneInfo) -> datetime:
    """The naive wall-clock time of instant ``t`` in ``zone``, to the second."""
    return t.astimezone(zone).replace(tzinfo=None, microsecond=0, fold=0)


def _walls(expression: str, start: datetime, reverse: bool = False) -> Iterator[datetime]:
    """Matching naive wall times after ``start`` (before it, in reverse), per cronsim."""
    from cronsim import CronSim

    it = CronSim(expression, start, reverse=reverse)
    while True:
        try:
            yield next(it)
        except StopIteration:
            return


def _resolve(wall: datetime, zone: ZoneInfo) -> datetime:
    """The instant (UTC) a matching wall time fires at: its first occurrence, or for a wall
    time inside a daylight-saving gap, the end of the gap."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if first.astimezone(zone).replace(tzinfo=None) == wall:
        return first  # exists (if it exists twice, fold=0 is the first pass)
    # In a gap, fold=1 reads the wall time with the offset after the transition and fold=0
    # with the one before: the transition lies between the two. Find it to the second.
    low = int(wall.replace(tzinfo=zone, fold=1).timestamp())
    high = int(first.timestamp())
    if low > high:
        low, high = high, low
    offset_after = datetime.fromtimestamp(high, zone).utcoffset()
    while low < high:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, zone).utcoffset() == offset_after:
            high = middle
        else:
            low = middle + 1
    return datetime.fromtimestamp(high, UTC)


def describe_fields() -> tuple[str, ...]:
    """The five cron fields, in order (for help texts)."""
    return _FIELD_NAMES
