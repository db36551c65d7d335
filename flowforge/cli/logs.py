"""``flowforge logs TASK_RUN_ID [--attempt N] [--follow] [--json]``: what an attempt wrote.

Prints the attempt's captured output (its ``ctx.log`` records, stdout and stderr: the tail of
``worker.log_capture_bytes``), one line each, escaped (handler output is untrusted: it may
hold terminal escapes), after a ``[… N bytes dropped …]`` line when the front was dropped.
Default: the latest attempt. ``--follow`` prints new lines as the running attempt's worker
writes them (every ``worker.output_flush_ms``) until that attempt ends; started before the
task has an attempt, it waits for its first. ``--json``: the api's shape
(``GET /api/v1/task-runs/{id}/logs``). A bad id or attempt number exits 2 before anything
connects; an unknown task run or attempt exits 5.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain.model import parse_id
from flowforge.domain.output import parse_attempt
from flowforge.domain.states import FINISHED_TASK_STATES
from flowforge.errors import InputError
from flowforge.views import attempt_log_dict

if TYPE_CHECKING:
    from flowforge.domain.output import AttemptLog

#: How often ``--follow`` reads the stored output (seconds).
FOLLOW_POLL_S = 0.5


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``logs`` on the ``flowforge`` subcommands (``sub``)."""
    p = sub.add_parser(
        "logs", help="what a task run's attempt wrote (ctx.log, stdout, stderr)", parents=[common]
    )
    p.set_defaults(handler=logs)
    p.add_argument("task_run_id", metavar="TASK_RUN_ID")
    p.add_argument("--attempt", default=None, help="the attempt, from 1 (default: the latest)")
    p.add_argument(
        "--follow", "-f", action="store_true", help="print new lines until the attempt ends"
    )
    p.add_argument("--json", action="store_true", help="print JSON (not with --follow)")


def logs(args: argparse.Namespace) -> int:
    # every argument is judged before anything connects
    task_run_id = parse_id(args.task_run_id, "task run id")
    attempt = parse_attempt(args.attempt, "--attempt")
    if args.json and args.follow:
        raise InputError("--json and --follow cannot be combined")
    from flowforge.cli.statements import opened  # the database layer only for a valid line

    with opened(load_config(getattr(args, "config", None))) as store:

        def read(number: int | None) -> AttemptLog:
            return store.attempt_log(task_run_id, number)

        if args.follow:
            follow(read, attempt)
            return exitcodes.OK
        found = read(attempt)
    if args.json:
        output.emit_json(attempt_log_dict(found))
    else:
        Printer().show(found)
    return exitcodes.OK


class Printer:
    """Prints an attempt's output past what it printed already (its offset counts every byte
    the attempt wrote, the dropped ones included)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.printed = 0
        self._out = out or sys.stdout

    def show(self, found: AttemptLog) -> None:
        data = found.output.text.encode("utf-8")
        dropped = found.output.dropped
        if dropped + len(data) <= self.printed:
            return
        if self.printed < dropped:
            output.line(f"[… {dropped - self.printed} bytes dropped …]", self._out)
            new = data
        else:
            new = data[self.printed - dropped :]
        for text_line in new.decode("utf-8", "replace").removesuffix("\n").split("\n"):
            output.line(text_line, self._out)
        self.printed = dropped + len(data)


def follow(
    read: Callable[[int | None], AttemptLog],
    attempt: int | None,
    sleep: Callable[[float], None] = time.sleep,
    out: TextIO | None = None,
) -> AttemptLog:
    """Print ``attempt``'s output (None: the latest; none yet: the first to start) as it is
    written, until it has ended (or the task ended without one); returns its last read."""
    printer = Printer(out)
    while True:
        found = read(attempt)
        if attempt is None and found.attempt is not None:
            attempt = found.attempt  # from now on this attempt, not a later retry
        printer.show(found)
        if found.attempt is not None and found.finished_at is not None:
            return found
        if found.attempt is None and found.task_state in FINISHED_TASK_STATES:
            return found
        sleep(FOLLOW_POLL_S)
