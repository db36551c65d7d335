"""``flowforge status RUN_ID --wait [--timeout S]``: wait for the run to finish, then show it
and exit by its state — 0 SUCCEEDED, 8 FAILED, 9 CANCELLED, 10 not finished in time (README,
"Exit codes"). Without ``--wait``, ``status`` shows the run as it is and exits 0."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowforge.cli import exitcodes, output
from flowforge.domain.states import RunState
from flowforge.durations import parse_duration
from flowforge.errors import InputError, WaitTimeoutError
from flowforge.waiting import wait_timeout

if TYPE_CHECKING:
    from flowforge.client import Client
    from flowforge.domain.model import Run

#: ``--timeout`` when none is given: a wait is always bounded (docs/failure-model.md, 94).
DEFAULT_TIMEOUT_S = 3600.0
#: A finished run's exit code.
BY_STATE = {
    RunState.SUCCEEDED: exitcodes.OK,
    RunState.FAILED: exitcodes.RUN_FAILED,
    RunState.CANCELLED: exitcodes.RUN_CANCELLED,
}
_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{1,6})?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait until the run is finished; exit 0 SUCCEEDED, 8 FAILED, 9 CANCELLED, "
        "10 timed out",
    )
    parser.add_argument(
        "--timeout",
        default=None,
        help="with --wait: give up after this long, seconds or 30s, 10m, 2h (default 1h)",
    )


@dataclass(frozen=True)
class Outcome:
    """The run to show, and the timeout that ended the wait (None: finished, or no wait)."""

    run: Run
    timed_out: WaitTimeoutError | None = None


def timeout_of(args: argparse.Namespace) -> float | None:
    """Seconds to wait (None: no ``--wait``); :class:`InputError` for a bad ``--timeout`` or
    one without ``--wait`` — before any connection is opened."""
    text: str | None = args.timeout
    if not args.wait:
        if text is not None:
            raise InputError("--timeout needs --wait")
        return None
    if text is None:
        return DEFAULT_TIMEOUT_S
    if _SECONDS.fullmatch(text):
        return wait_timeout(float(text), "--timeout")
    try:
        return wait_timeout(parse_duration(text), "--timeout")
    except ValueError as exc:
        raise InputError(f"--timeout: {exc}; or a number of seconds") from exc


def read(client: Client, run_id: str, timeout_s: float | None) -> Outcome:
    """The run now (``timeout_s`` None), or once finished, or as last read at the timeout."""
    if timeout_s is None:
        return Outcome(client.status(run_id))
    try:
        return Outcome(client.wait(run_id, timeout_s))
    except WaitTimeoutError as exc:
        if exc.run is None:
            raise
        return Outcome(exc.run, exc)


def exit_code(outcome: Outcome, waited: bool) -> int:
    """0 without a wait; else by the final state, or, after a timeout, its line on stderr and
    :data:`~flowforge.cli.exitcodes.WAIT_TIMEOUT`."""
    if outcome.timed_out is not None:
        output.line(f"flowforge: {output.one_line(str(outcome.timed_out))}", sys.stderr)
        return exitcodes.WAIT_TIMEOUT
    if not waited:
        return exitcodes.OK
    return BY_STATE[outcome.run.state]
