"""``flowforge task cancel|retry-now|bury TASK_RUN_ID`` and ``flowforge keys show KEY``: an
operator's control of one task (SPEC 7.4; docs/flow-control.md "Controlling single tasks").

Each action is audited (``--by``, default the OS user; ``--reason``) and prints what it did:
the state the task went from and to, or that it was asked to stop (a worker executes it: it
ends when its worker stops). A bad id or note is exit 2, checked before anything connects; an
unknown task exit 5; a state that refuses the action exit 6, naming the state. ``--json``: the
API's answer.
"""

from __future__ import annotations

import argparse
import getpass
from typing import TYPE_CHECKING, Any

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain.control import Action, Effect, HoldKind, KeyHold
from flowforge.domain.model import parse_id
from flowforge.domain.states import TaskState
from flowforge.domain.values import MAX_KEY_BYTES, MAX_NOTE_BYTES, check_text
from flowforge.views import controlled_dict, key_holds_dict

if TYPE_CHECKING:
    from flowforge.client import Client

_HELP = {
    Action.CANCEL: "cancel one task (what only it feeds is cancelled too), audited",
    Action.RETRY_NOW: "dispatch a RETRYING task now, its backoff skipped, audited",
    Action.BURY: "bury one task by hand: DEAD, reason operator, audited",
}


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``task`` and ``keys`` on the ``flowforge`` subcommands (``sub``)."""
    task = sub.add_parser("task", help="control one task run", parents=[common])
    actions = task.add_subparsers(dest="action", required=True, parser_class=type(task))
    for action in Action:
        p = actions.add_parser(action.replace("_", "-"), help=_HELP[action], parents=[common])
        p.set_defaults(handler=control, control=action)
        p.add_argument("task_run_id")
        p.add_argument("--reason", default=None, help="recorded in the audit row")
        p.add_argument("--by", default=None, help="who acts (default: the OS user)")
        p.add_argument("--json", action="store_true", help="print JSON")
    keys = sub.add_parser("keys", help="ordering, concurrency and rate keys", parents=[common])
    shows = keys.add_subparsers(dest="action", required=True, parser_class=type(keys))
    p = shows.add_parser(
        "show", help="what holds a key: the task(s), their state and run, why", parents=[common]
    )
    p.set_defaults(handler=show_key)
    p.add_argument("key")
    p.add_argument("--json", action="store_true", help="print JSON")


def _client(args: argparse.Namespace) -> Client:
    from flowforge.client import Client  # the database layer only for a valid command line

    return Client(load_config(getattr(args, "config", None)))


def control(args: argparse.Namespace) -> int:
    action: Action = args.control
    # judged before anything connects: a typo costs no database round trip
    tid = parse_id(args.task_run_id, "task run id")
    by = args.by or getpass.getuser()
    check_text(by, "--by", MAX_NOTE_BYTES)
    if args.reason is not None:
        check_text(args.reason, "--reason", MAX_NOTE_BYTES)
    with _client(args) as client:
        act = {
            Action.CANCEL: client.cancel_task,
            Action.RETRY_NOW: client.retry_task_now,
            Action.BURY: client.bury_task,
        }[action]
        done = act(tid, by, args.reason)
    if args.json:
        output.emit_json(controlled_dict(done))
    elif done.effect is Effect.STOP:
        output.line(
            f"task run {done.task.id} ({done.task.name}) is RUNNING: asked to stop; it ends "
            f"{'DEAD (operator)' if action is Action.BURY else 'CANCELLED'} when its worker stops"
        )
    else:
        output.line(
            f"task run {done.task.id} ({done.task.name}): {done.previous_state} -> "
            f"{done.task.state}"
        )
    return exitcodes.OK


def show_key(args: argparse.Namespace) -> int:
    check_text(args.key, "the key", MAX_KEY_BYTES)
    with _client(args) as client:
        holds = client.key_holds(args.key)
    if args.json:
        output.emit_json(key_holds_dict(args.key, holds))
        return exitcodes.OK
    if not holds:
        output.line(f"nothing holds key {args.key!r}")
        return exitcodes.OK
    for hold in holds:
        _print_hold(hold)
    return exitcodes.OK


def _print_hold(hold: KeyHold) -> None:
    if hold.kind is HoldKind.RATE_LIMIT:
        ready = sum(1 for t in hold.holders if t.state is TaskState.READY)
        output.line(
            f"{hold.kind} key {hold.key!r} ({hold.limit} per {hold.per_s:g}s): {hold.started} "
            f"started in the last {hold.per_s:g}s, {ready} READY, {hold.waiting} waiting"
        )
    else:
        output.line(
            f"{hold.kind} key {hold.key!r} (limit {hold.limit}): held by {len(hold.holders)}, "
            f"{hold.waiting} waiting"
        )
    output.table(
        ("ROLE", "TASK RUN", "RUN", "WORKFLOW", "TASK", "STATE", "REASON", "WHY"),
        [
            (role, t.id, t.run_id, t.workflow, t.name, t.state, t.failure_reason, t.why)
            for role, tasks in (("holds", hold.holders), ("waits", hold.next))
            for t in tasks
        ],
    )
    if hold.waiting > len(hold.next):
        output.line(f"... and {hold.waiting - len(hold.next)} more waiting")
