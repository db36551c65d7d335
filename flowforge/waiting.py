"""Waiting for a run to finish (``Client.wait``, ``flowforge status --wait``).

The engine sends no notification when a run finishes (its state is derived by the scheduler's
``propagate`` pass, which notifies nobody outside the tree), so a waiter reads the run again
with a growing interval: the first look again after :data:`FIRST_INTERVAL_S`, doubling up to
:data:`MAX_INTERVAL_S`, never past the caller's deadline. A waiter therefore costs at most one
run read per :data:`MAX_INTERVAL_S` once it has waited a while, and notices the end of a run
at most that long after it happened. The deadline is the caller's own: a span measured on this
process's monotonic clock (how long the caller is willing to wait), not an instant of the
database's clock, which orders the engine's own events.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flowforge.domain.model import Run
from flowforge.domain.runstate import TERMINAL_RUN_STATES
from flowforge.domain.states import FINISHED_TASK_STATES
from flowforge.domain.timing import seconds
from flowforge.errors import WaitTimeoutError
from flowforge.text import escape

#: Seconds before the second read of an unfinished run.
FIRST_INTERVAL_S = 0.05
#: Longest pause between two reads, in seconds.
MAX_INTERVAL_S = 1.0
#: Unfinished tasks named in a timeout's message, at most.
SHOWN_TASKS = 5


def wait_timeout(value: object, label: str = "timeout") -> float:
    """``value`` (seconds as a number, or a timedelta) as seconds in (0, 366 days];
    :class:`~flowforge.errors.InputError` naming ``label`` otherwise (None, a bool, a string,
    NaN, infinity, zero, a negative or a larger number)."""
    return seconds(value, label)


def wait_for_run(
    read: Callable[[], Run],
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Run:
    """Read the run with ``read`` until it is finished (SUCCEEDED, FAILED or CANCELLED) and
    return it; :class:`~flowforge.errors.WaitTimeoutError` (with the last run read) when it is
    not finished ``timeout_s`` seconds (by ``clock``) after the call. The run is read once more
    at the deadline, so a run that finished during the last pause is returned, not a timeout.
    Errors of ``read`` (an unknown id, an outage) propagate as they are."""
    deadline = clock() + timeout_s
    interval = FIRST_INTERVAL_S
    while True:
        run = read()
        if run.state in TERMINAL_RUN_STATES:
            return run
        left = deadline - clock()
        if left <= 0:
            raise WaitTimeoutError(timeout_message(run, timeout_s), run)
        sleep(min(interval, left))
        interval = min(interval * 2, MAX_INTERVAL_S)


def timeout_message(run: Run, timeout_s: float) -> str:
    """One line: the run, its state, how long was waited, and its unfinished tasks with what
    each waits on (escaped: task names and reasons are stored text)."""
    unfinished = [t for t in run.tasks if t.state not in FINISHED_TASK_STATES]
    shown = ", ".join(
        f"{t.name} {t.state}" + (f" (waiting on {t.waiting_on})" if t.waiting_on else "")
        for t in unfinished[:SHOWN_TASKS]
    )
    more = f" and {len(unfinished) - SHOWN_TASKS} more" if len(unfinished) > SHOWN_TASKS else ""
    tasks = f": {shown}{more}" if shown else ""
    return escape(
        f"run {run.id} is still {run.state} after waiting {timeout_s:g}s"
        f"{tasks}" + (" (is a tree running?)" if run.state == "PENDING" else "")
    )
