"""``flowforge breakers list|open|close`` and ``flowforge pause|resume queue|handler NAME``:
circuit breakers and pauses (SPEC 7.4; docs/flow-control.md "Circuit breakers and pauses").

``--key KEY`` names one key's breaker of the handler (``circuit_breaker.key``); without it,
the handler's own breaker. Each action is audited (``--by``, default the OS user;
``--reason``). A bad name, key or note is exit 2, checked before anything connects; a handler
no workflow names exit 5; a state that refuses the action (a breaker held open already or
closed, a queue paused already or not paused) exit 6. ``--json``: the API's answer.
"""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain.breakers import (
    GateChange,
    breaker_name,
    check_breaker_key,
    check_handler_name,
    check_pause_target,
)
from flowforge.domain.values import MAX_NOTE_BYTES, check_text
from flowforge.views import breaker_dict, gate_change_dict, pause_dict


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``breakers``, ``pause`` and ``resume`` on the ``flowforge`` subcommands."""
    breakers = sub.add_parser("breakers", help="circuit breakers of handlers", parents=[common])
    acts = breakers.add_subparsers(dest="action", required=True, parser_class=type(breakers))
    p = acts.add_parser("list", help="every breaker: state, failures, cooldown", parents=[common])
    p.set_defaults(handler=list_breakers)
    p.add_argument("name", nargs="?", default=None, metavar="HANDLER")
    p.add_argument("--key", default=None, help="only this key's breaker")
    p.add_argument("--json", action="store_true", help="print JSON")
    for action, text in (
        ("open", "open a handler's breaker and hold it open (no probe), audited"),
        ("close", "close a handler's breaker: its parked tasks run again, audited"),
    ):
        p = acts.add_parser(action, help=text, parents=[common])
        p.set_defaults(handler=breaker_action, act=action)
        p.add_argument("name", metavar="HANDLER")
        p.add_argument(
            "--key", default=None, help="that key's breaker (default: the handler's own)"
        )
        _note_flags(p)
    for verb, text in (
        ("pause", "stop claiming the tasks of a queue or a handler, audited"),
        ("resume", "claim the tasks of a paused queue or handler again, audited"),
    ):
        cmd = sub.add_parser(verb, help=text, parents=[common])
        scopes = cmd.add_subparsers(dest="scope", required=True, parser_class=type(cmd))
        for scope in ("queue", "handler"):
            p = scopes.add_parser(scope, help=f"{verb} a {scope}", parents=[common])
            p.set_defaults(handler=pause_action, act=verb)
            p.add_argument("name", metavar=scope.upper())
            _note_flags(p)
        if verb == "pause":
            p = scopes.add_parser("list", help="the paused queues and handlers", parents=[common])
            p.set_defaults(handler=list_pauses)
            p.add_argument("--json", action="store_true", help="print JSON")


def _note_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", default=None, help="recorded in the audit row")
    p.add_argument("--by", default=None, help="who acts (default: the OS user)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _note(args: argparse.Namespace) -> tuple[str, str | None]:
    by = args.by or getpass.getuser()
    check_text(by, "--by", MAX_NOTE_BYTES)
    if args.reason is not None:
        check_text(args.reason, "--reason", MAX_NOTE_BYTES)
    return by, args.reason


def list_breakers(args: argparse.Namespace) -> int:
    if args.name is not None:
        check_handler_name(args.name)
    if args.key is not None:
        check_breaker_key(args.key, "--key")
    from flowforge.cli.statements import opened

    with opened(load_config(getattr(args, "config", None))) as store:
        found = store.breakers(args.name, args.key)
    if args.json:
        output.emit_json({"breakers": [breaker_dict(b) for b in found]})
        return exitcodes.OK
    if not found:
        output.line("no breaker has tripped or been opened")
        return exitcodes.OK
    output.table(
        (
            "HANDLER",
            "KEY",
            "STATE",
            "HELD",
            "FAILURES",
            "RULE",
            "PROBE IN",
            "PARKED",
            "TRANSITIONS",
        ),
        [
            (
                b.handler,
                b.key,  # '': the handler's own breaker
                b.state,
                "yes" if b.held else "",
                b.recent_failures,
                "" if b.failures is None else f"{b.failures} in {b.window_s:g}s, {b.cooldown_s:g}s",
                "" if b.probe_due_in_s is None else f"{b.probe_due_in_s:.0f}s",
                b.parked,
                b.transitions,
            )
            for b in found
        ],
    )
    return exitcodes.OK


def list_pauses(args: argparse.Namespace) -> int:
    from flowforge.cli.statements import opened

    with opened(load_config(getattr(args, "config", None))) as store:
        found = store.pauses()
    if args.json:
        output.emit_json({"pauses": [pause_dict(p) for p in found]})
        return exitcodes.OK
    if not found:
        output.line("nothing is paused")
        return exitcodes.OK
    output.table(
        ("SCOPE", "NAME", "BY", "SINCE", "PARKED", "REASON"),
        [(p.scope, p.name, p.paused_by, p.paused_at, p.parked, p.reason) for p in found],
    )
    return exitcodes.OK


def breaker_action(args: argparse.Namespace) -> int:
    handler = check_handler_name(args.name)  # judged before anything connects
    key = None if args.key is None else check_breaker_key(args.key, "--key")
    by, reason = _note(args)
    from flowforge.cli.statements import opened

    with opened(load_config(getattr(args, "config", None))) as store:
        act = store.open_breaker if args.act == "open" else store.close_breaker
        return _done(args, act(handler, by, reason, key))


def pause_action(args: argparse.Namespace) -> int:
    scope, name = check_pause_target(args.scope, args.name)
    by, reason = _note(args)
    from flowforge.cli.statements import opened

    with opened(load_config(getattr(args, "config", None))) as store:
        act = store.pause if args.act == "pause" else store.resume
        return _done(args, act(str(scope), name, by, reason))


def _done(args: argparse.Namespace, done: GateChange) -> int:
    if args.json:
        output.emit_json(gate_change_dict(done))
    else:
        what = (
            breaker_name(done.name, done.key)
            if done.action.startswith("breaker")
            else f"{done.scope} {done.name!r}"
        )
        output.line(f"{what}: {done.previous_state} -> {done.new_state}")
    return exitcodes.OK
