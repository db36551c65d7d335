"""``flowforge schedules list|show|pause|resume|trigger``: the operator's view of schedules.

A schedule is named ``workflow/index`` (from 0, in file order) unless its file gives it a
``name:``. Everything here goes through the :class:`~flowforge.client.Client` (``trigger``
needs the workflows the config names; the rest read or change the ``schedules`` table).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain.model import FireRecord, ScheduleInfo
from flowforge.errors import InputError
from flowforge.views import fire_dict, manual_fire_dict, schedule_dict

if TYPE_CHECKING:
    from flowforge.client import Client

#: Decisions ``schedules show`` lists unless --limit says otherwise.
HISTORY = 20


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``schedules`` on the ``flowforge`` subcommands (``sub``)."""
    group = sub.add_parser(
        "schedules", help="workflows that run by themselves (cron / every)", parents=[common]
    )
    group.set_defaults(handler=lambda _args: exitcodes.USAGE)
    actions = group.add_subparsers(dest="action", required=True, parser_class=type(group))

    def action(name: str, handler: Any, help: str, named: bool = True) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = actions.add_parser(name, help=help, parents=[common])
        p.set_defaults(handler=handler)
        if named:
            p.add_argument("name", help="workflow/index, or the schedule's name:")
        p.add_argument("--json", action="store_true", help="print JSON")
        return p

    action("list", list_schedules, "every schedule: state, next and last fire, last run", False)
    p = action("show", show, "one schedule and its latest fire decisions")
    p.add_argument("--limit", type=int, default=HISTORY, help=f"decisions shown ({HISTORY})")
    action("pause", pause, "stop firing until resumed")
    action("resume", resume, "fire again (what passed meanwhile is recorded skipped)")
    action("trigger", trigger, "start a run now, outside the timetable")


def _client(args: argparse.Namespace) -> Client:
    from flowforge.client import Client  # the database layer only for a valid command line

    return Client(load_config(getattr(args, "config", None)))


def list_schedules(args: argparse.Namespace) -> int:
    with _client(args) as client:
        found = client.schedules()
    if args.json:
        output.emit_json({"schedules": [schedule_dict(s) for s in found]})
        return exitcodes.OK
    output.table(
        ("NAME", "WORKFLOW", "TIMETABLE", "TIMEZONE", "STATE", "NEXT", "LAST FIRE", "LAST RUN"),
        [_row(s) for s in found],
    )
    return exitcodes.OK


def _row(info: ScheduleInfo) -> tuple[Any, ...]:
    data = schedule_dict(info)
    return (
        info.name,
        info.workflow,
        data["timetable"],
        data["timezone"],
        info.state,
        info.next_fire_at,
        info.last_fire_at,
        _last(info),
    )


def _last(info: ScheduleInfo) -> str | None:
    """What the last run did, or the last decision if it made none (skipped: why)."""
    decision = info.last_decision
    if decision is not None and decision.outcome == "skipped":
        return f"skipped ({decision.reason})"
    if info.last_run_id is None:
        return None
    return f"{info.last_run_state or 'purged'} {info.last_run_id}"


def show(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise InputError("--limit must be from 1 to 1000")
    with _client(args) as client:
        info = client.schedule(args.name)
        history = client.schedule_history(args.name, args.limit)
    if args.json:
        output.emit_json({**schedule_dict(info), "history": [fire_dict(f) for f in history]})
        return exitcodes.OK
    _describe(info)
    output.table(
        ("FIRE TIME", "THROUGH", "OUTCOME", "REASON", "RUN", "DECIDED"),
        [_decision(f) for f in history],
    )
    return exitcodes.OK


def _decision(record: FireRecord) -> tuple[Any, ...]:
    through = record.last_fire_time if record.last_fire_time != record.fire_time else None
    outcome = f"{record.outcome} (manual)" if record.manual else record.outcome
    return (record.fire_time, through, outcome, record.reason, record.run_id, record.decided_at)


def _describe(info: ScheduleInfo) -> None:
    data = schedule_dict(info)
    output.line(
        f"schedule {info.name}  workflow {info.workflow}  {data['timetable']} "
        f"({data['timezone']})  {info.state}"
    )
    spec = data["spec"]
    output.line(
        f"catch_up {spec.get('catch_up')} (max {spec.get('max_catch_up')})  "
        f"overlap {spec.get('overlap')}  input {output.dumps(spec.get('input', {}))}"
    )
    output.table(
        ("NEXT", "LAST FIRE", "LAST RUN"), [(info.next_fire_at, info.last_fire_at, _last(info))]
    )


def pause(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.pause_schedule(args.name)
    return _after(args, info, "paused")


def resume(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.resume_schedule(args.name)
    return _after(args, info, "resumed")


def _after(args: argparse.Namespace, info: ScheduleInfo, verb: str) -> int:
    if args.json:
        output.emit_json(schedule_dict(info))
    else:
        nxt = f"{info.next_fire_at:%Y-%m-%d %H:%M:%S}" if info.next_fire_at else "-"
        output.line(f"{verb} {info.name} (state {info.state}, next fire {nxt})")
    return exitcodes.OK


def trigger(args: argparse.Namespace) -> int:
    with _client(args) as client:
        fired = client.trigger_schedule(args.name)
    if args.json:
        output.emit_json(manual_fire_dict(fired))
    else:
        output.line(str(fired.run_id))
    return exitcodes.OK
