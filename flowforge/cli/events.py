"""``flowforge event send NAME --key K [--data JSON]``: wake the tasks waiting for an event.

Prints the event's id and one line per task it woke (``--json``: the API's answer). A bad
name, key or data is one line naming it, exit 2, and nothing is stored.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.errors import InputError
from flowforge.views import event_dict

if TYPE_CHECKING:
    from flowforge.client import Client


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``event`` on the ``flowforge`` subcommands (``sub``)."""
    group = sub.add_parser("event", help="events that waiting tasks wait for", parents=[common])
    group.set_defaults(handler=lambda _args: exitcodes.USAGE)
    actions = group.add_subparsers(dest="action", required=True, parser_class=type(group))
    p = actions.add_parser(
        "send", help="send an event: wakes every task waiting for it", parents=[common]
    )
    p.set_defaults(handler=send)
    p.add_argument("name", help="the event's name (wait_for_event.name)")
    p.add_argument("--key", required=True, help="the key the waits' templates render")
    p.add_argument("--data", default=None, help="JSON: the woken tasks' result")
    p.add_argument("--json", action="store_true", help="print JSON")


def _client(args: argparse.Namespace) -> Client:
    from flowforge.client import Client  # the database layer only for a valid command line

    return Client(load_config(getattr(args, "config", None)))


def send(args: argparse.Namespace) -> int:
    data = None
    if args.data is not None:
        try:
            data = json.loads(args.data)
        except json.JSONDecodeError as exc:
            raise InputError(f"--data is not valid JSON: {exc.msg} at position {exc.pos}") from exc
    with _client(args) as client:
        sent = client.send_event(args.name, args.key, data)
    if args.json:
        output.emit_json(event_dict(sent))
        return exitcodes.OK
    output.line(f"event {sent.id} woke {len(sent.woke)} task(s)")
    for woken in sent.woke:
        output.line(f"  run {woken.run_id}  task {woken.task}")
    return exitcodes.OK
