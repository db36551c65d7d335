"""The log lines an operator greps for when a task fails, retries, dies or is cancelled.

One line per event, written by the role that decided it: the worker when an attempt ends
otherwise than in success (:func:`attempt_ended`), the scheduler when it routes a failed
attempt or reaps an expired lease (:func:`routed`). Successes are never logged here: at
thousands of tasks a second a line each would drown everything else.

Every line starts ``task run <id> (run <id>, <workflow>/<task>, attempt <n>)`` so one grep
finds a task's whole story; JSON logs carry the same facts as fields. Error text comes from
handlers, so it is untrusted: only its first line is logged, with control characters escaped
(a newline cannot forge a second log line, an escape sequence cannot drive a terminal). The
traceback is never logged; it is stored on the attempt (``flowforge attempts``).
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from flowforge.domain.model import Claim, Finish, Routed
from flowforge.domain.states import TaskState
from flowforge.text import escape

#: Longest first line of an error that a log line carries (characters, before escaping).
MAX_LOGGED_ERROR_CHARS = 500
ELLIPSIS = "…"


def first_line(text: str | None) -> str:
    """The first line of ``text``, at most :data:`MAX_LOGGED_ERROR_CHARS` long, escaped."""
    lines = (text or "").splitlines()
    line = lines[0] if lines else ""
    if len(line) > MAX_LOGGED_ERROR_CHARS:
        line = line[:MAX_LOGGED_ERROR_CHARS] + ELLIPSIS
    return escape(line)


def attempt_ended(logger: logging.Logger, claim: Claim, finish: Finish) -> None:
    """Log an attempt the worker finished as FAILED, DEAD or CANCELLED (committed)."""
    head, args, extra = _head(
        claim.task_run_id, claim.run_id, claim.workflow, claim.name, claim.attempt
    )
    if finish.state is TaskState.CANCELLED:
        logger.info(
            head + " stopped: cancelled", *args, extra={**extra, "action": "task_cancelled"}
        )
        return
    reason = str(finish.reason)
    error = first_line(finish.error)
    level = logging.WARNING if finish.state is TaskState.DEAD else logging.INFO
    verb = "is DEAD" if finish.state is TaskState.DEAD else "failed"
    logger.log(
        level,
        head + f" {verb}: %s: %s",
        *args,
        reason,
        error,
        extra={**extra, "action": "task_failed", "reason": reason, "error": error},
    )


def routed(logger: logging.Logger, event: Routed) -> None:
    """Log what the scheduler decided for a failed attempt or an expired lease."""
    head, args, extra = _head(
        event.task_run_id, event.run_id, event.workflow, event.task, event.attempt
    )
    reason = str(event.reason)
    extra = {**extra, "reason": reason, "from_state": str(event.source)}
    if event.state is TaskState.RETRYING:
        logger.info(
            head + " will retry in %.2fs: %s",
            *args,
            event.delay_s,
            reason,
            extra={**extra, "action": "task_retrying", "delay_s": event.delay_s},
        )
    elif event.state is TaskState.DEAD:
        logger.warning(head + " is DEAD: %s", *args, reason, extra={**extra, "action": "task_dead"})
    else:
        logger.info(
            head + " cancelled: %s", *args, reason, extra={**extra, "action": "task_cancelled"}
        )


def _head(
    task_run_id: UUID, run_id: UUID, workflow: str, task: str, attempt: int
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The common start of every line, its arguments, and the same facts as JSON fields."""
    names = f"{escape(workflow)}/{escape(task)}" if workflow else escape(task)
    return (
        "task run %s (run %s, %s, attempt %d)",
        (task_run_id, run_id, names, attempt),
        {
            "task_run_id": str(task_run_id),
            "run_id": str(run_id),
            "workflow": workflow,
            "task": task,
            "attempt": attempt,
        },
    )
