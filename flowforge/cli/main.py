"""The ``flowforge`` command: argument parsing and dispatch; each error's exit code comes from
the one error map (flowforge/errormap.py).

Operator mistakes print one line on stderr and exit non-zero; logs go to stderr only with
``-v``. No traceback reaches the terminal except for a genuine internal error under ``-vv``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from flowforge.cli import (
    commands,
    dev,
    events,
    exitcodes,
    export,
    gates,
    items,
    logs,
    output,
    purge,
    schedules,
    tasks,
    wait,
)
from flowforge.errormap import exit_code_for
from flowforge.errors import FlowForgeError

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"flowforge: error: {output.one_line(message)} (see --help)\n")
        raise SystemExit(exitcodes.USAGE)


class _Version(argparse.Action):
    """``--version``: ``flowforge X.Y.Z`` on stdout, exit 0 (looked up only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        sys.stdout.write(f"flowforge {version()}\n")
        raise SystemExit(exitcodes.OK)


def version() -> str:
    """The installed distribution's version; in a checkout that is not installed, the package's
    ``__version__`` (which pyproject.toml reads, so the two cannot differ)."""
    try:
        return importlib.metadata.version("flowforge")
    except importlib.metadata.PackageNotFoundError:
        from flowforge import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    # SUPPRESS keeps a -c given before the subcommand from being reset by the subparser.
    common.add_argument(
        "-c", "--config", default=argparse.SUPPRESS, help="config file (or $FLOWFORGE_CONFIG)"
    )
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log to stderr"
    )
    parser = _Parser(prog="flowforge", description="A durable workflow engine.", parents=[common])
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, parents=[common])
        p.set_defaults(handler=handler)
        return p

    def json_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON")

    command("up", commands.up, "run the whole process tree (scheduler, publisher, workers)")
    command("migrate", commands.migrate, "create or upgrade the database schema")

    p = command("role", commands.role, "run one role in the foreground (what `up` forks)")
    p.add_argument("name", choices=("scheduler", "publisher", "worker", "api"))

    p = command("trigger", commands.trigger, "start a run; prints its id")
    p.add_argument("workflow")
    p.add_argument("--input", default="{}", help="the run input as a JSON object")
    p.add_argument("--idempotency-key", default=None)
    p.add_argument(
        "--at", default=None, help="start at this ISO 8601 time with an offset (SCHEDULED until)"
    )
    p.add_argument("--delay", default=None, help="start after this long, e.g. 10m (SCHEDULED)")
    p.add_argument("--deadline", default=None, help="end the run FAILED if unfinished after: 2h")
    p.add_argument(
        "--priority",
        default=None,
        help="0 to 9, higher first within a queue: every task of the run (default: each its own)",
    )

    p = command("status", commands.status, "show a run and its tasks (--wait: once finished)")
    p.add_argument("run_id")
    json_flag(p)
    wait.add_arguments(p)

    p = command("runs", commands.runs, "list runs, newest first")
    p.add_argument("--state", default=None)
    p.add_argument("--workflow", default=None)
    p.add_argument("--limit", type=int, default=50)
    json_flag(p)

    p = command("cancel", commands.cancel, "cancel a run")
    p.add_argument("run_id")
    json_flag(p)

    p = command(
        "rerun",
        commands.rerun,
        "run a finished run again from its failed tasks (or --from TASK), audited",
    )
    p.add_argument("run_id")
    p.add_argument(
        "--from", default=None, metavar="TASK", help="also rerun TASK and what follows it"
    )
    p.add_argument("--reason", default=None, help="recorded in the audit row")
    p.add_argument("--by", default=None, help="who reruns (default: the OS user)")
    json_flag(p)

    p = command("stats", commands.stats, "retries, failure reasons, backlog, poison, dead tasks")
    p.add_argument("--poison-threshold", type=int, default=3, help="attempts (default 3)")
    json_flag(p)

    p = command("ps", commands.ps, "live processes of every tree (from the registry)")
    json_flag(p)

    dead = command("dead", commands.no_action, "dead tasks").add_subparsers(
        dest="action", required=True, parser_class=_Parser
    )
    p = dead.add_parser("list", help="list dead tasks", parents=[common])
    p.set_defaults(handler=commands.dead_list)
    p.add_argument("--limit", type=int, default=100)
    json_flag(p)
    # the filters of GET /api/v1/dead, spelled as its parameters
    p.add_argument("--reason", default=None, help="only this failure reason")
    p.add_argument("--workflow", default=None, help="only tasks of runs of this workflow")
    # (dest: `handler` is the subcommand's function)
    p.add_argument(
        "--handler", dest="task_handler", default=None, help="only tasks of this handler"
    )
    p = dead.add_parser("show", help="a dead task with its attempts", parents=[common])
    p.set_defaults(handler=commands.dead_show)
    p.add_argument("task_run_id")
    json_flag(p)
    p.add_argument(
        "--full", action="store_true", help="print each attempt's whole error and traceback"
    )
    p = dead.add_parser(
        "requeue", help="send a dead task back to be run (audited)", parents=[common]
    )
    p.set_defaults(handler=commands.dead_requeue)
    p.add_argument("task_run_id")
    p.add_argument("--reason", default=None, help="recorded in the audit row")
    p.add_argument("--by", default=None, help="who requeues (default: the OS user)")

    workflows = command("workflows", commands.no_action, "workflow definitions").add_subparsers(
        dest="action", required=True, parser_class=_Parser
    )
    p = workflows.add_parser("list", help="list the configured workflows", parents=[common])
    p.set_defaults(handler=commands.workflows_list)
    json_flag(p)
    p = workflows.add_parser(
        "validate", help="check workflow files (all configured ones by default)", parents=[common]
    )
    p.set_defaults(handler=commands.workflows_validate)
    p.add_argument("paths", nargs="*")
    export.add_command(workflows, common)
    purge.add_command(sub, common)
    schedules.add_command(sub, common)
    events.add_command(sub, common)
    items.add_command(sub, common)
    logs.add_command(sub, common)
    tasks.add_command(sub, common)
    gates.add_command(sub, common)
    dev.add_command(sub, common)
    return parser


def _configure_logging(verbosity: int) -> None:
    if verbosity <= 0:
        logging.disable(logging.CRITICAL)
        return
    logging.basicConfig(
        level=logging.DEBUG if verbosity > 1 else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


#: The commands that leave SIGTERM and SIGINT blocked as they found them: each unblocks them once
#: its handlers exist (supervisor/selfpipe.py), so a stop blocked until then is not lost. Every
#: other command unblocks them before it runs, so they stop it even when whoever started it
#: blocked them (the container image's entrypoint does, docs/operations.md).
KEEP_STOP_SIGNALS_BLOCKED = (commands.up, commands.role)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (the console script exits with it)."""
    args = build_parser().parse_args(argv)
    verbosity = getattr(args, "verbose", 0) or 0
    _configure_logging(verbosity)
    try:
        if args.handler not in KEEP_STOP_SIGNALS_BLOCKED:
            # the image's entrypoint starts every command with them blocked (for `up`'s sake); a
            # stop that came meanwhile arrives here, inside this try: SIGINT is "interrupted"
            signal.pthread_sigmask(signal.SIG_UNBLOCK, commands.STOP_SIGNALS)
        return int(args.handler(args))
    except FlowForgeError as exc:
        sys.stderr.write(f"flowforge: {_one_line(exc)}\n")
        return exit_code_for(exc)
    except KeyboardInterrupt:
        sys.stderr.write("flowforge: interrupted\n")
        return 130
    except BrokenPipeError:  # the reader went away (`flowforge runs | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.OK
    except Exception as exc:  # an internal error: still one line unless asked for more
        if verbosity > 1:
            logger.exception("internal error")
        sys.stderr.write(
            f"flowforge: internal error: {_one_line(exc)} (run with -vv for details)\n"
        )
        return exitcodes.INTERNAL


def _one_line(exc: BaseException) -> str:
    return output.one_line(str(exc)) or type(exc).__name__


def entry_point() -> NoReturn:
    sys.exit(main())
