"""One function per ``flowforge`` subcommand: parse the arguments' meaning, call the engine,
print the result. Each returns an exit code; errors propagate to ``main`` for mapping."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from flowforge.broker import quiet_pika_logs
from flowforge.cli import exitcodes, output, wait
from flowforge.config import (
    ENV_CONFIG,
    Config,
    config_from,
    load_config,
    log_warnings,
    read_config,
)
from flowforge.definitions import pool_problems
from flowforge.discovery import check_config
from flowforge.domain import maps
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.domain.timing import parse_instant
from flowforge.durations import parse_duration
from flowforge.errors import ConfigError, InputError
from flowforge.handlers import collect

if TYPE_CHECKING:  # imported where used: the other commands need none of the database layer
    from flowforge.cli.statements import CliStatements
    from flowforge.client import Client
    from flowforge.domain.model import TaskRun
    from flowforge.domain.output import Progress


def _config(args: argparse.Namespace, warn: bool = True) -> Config:
    """The config; its warnings are logged (seen with ``-v``) unless ``warn`` is False."""
    config = load_config(getattr(args, "config", None))
    if warn:
        log_warnings(config)
    return config


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[Client]:
    from flowforge.client import Client

    with Client(_config(args)) as client:
        yield client


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[CliStatements]:
    from flowforge.cli.statements import opened

    with opened(_config(args)) as store:
        yield store


def no_action(args: argparse.Namespace) -> int:  # argparse requires an action for groups
    return exitcodes.USAGE


def migrate(args: argparse.Namespace) -> int:
    config = _config(args)
    from flowforge.store.migrate import migrate as apply_migrations

    applied = apply_migrations(config.database.url)
    output.line(
        f"applied migrations: {', '.join(map(str, applied))}" if applied else "schema is up to date"
    )
    return exitcodes.OK


#: What stops ``flowforge up``: blocked from its start until the supervisor's handlers exist.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def up(args: argparse.Namespace) -> int:
    # A stop that comes before the supervisor's handlers exist stays pending (a blocked signal
    # survives the exec into the tree) and becomes a drain once they do. Unblocked, it would
    # end the process unannounced, and as PID 1 in a container (where the kernel ignores a
    # signal without a handler) it would be lost: `podman stop` would wait for its SIGKILL.
    # Blocked here, they are blocked only once the interpreter and the command line have
    # loaded; the container image's entrypoint blocks them before the exec (Containerfile).
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        from flowforge import up as tree
        from flowforge.tree import become_tree

        # a bad config stops here: one line, exit 2, nothing started; the tree logs its warnings
        source = read_config(getattr(args, "config", None))
        config = config_from(source)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        raise
    # the file load_config read: -c, else $FLOWFORGE_CONFIG (the container image's way)
    path = getattr(args, "config", None) or os.environ.get(ENV_CONFIG) or None
    label = Path(path).name if path else "defaults"
    if sys.executable:
        try:
            # the same pid, without the command line's modules
            become_tree(config, source, path, label)
        except OSError as exc:
            output.line(
                f"flowforge: no fresh interpreter ({exc}); running the tree here", sys.stderr
            )
    logging.disable(logging.NOTSET)
    return tree.run(config, label)


def role(args: argparse.Namespace) -> int:
    from flowforge.boot import run  # the roles pull in pika; other commands need not
    from supervisor import logs

    config = _config(args, warn=False)
    # the tree's line format and escaping (supervisor/logs.py), on this process's stderr
    logs.configure(args.name, config.logging.format, config.logging.level)
    logging.disable(logging.NOTSET)
    log_warnings(config)
    quiet_pika_logs()
    return run(args.name, config)


def trigger(args: argparse.Namespace) -> int:
    try:
        run_input = json.loads(args.input)
    except json.JSONDecodeError as exc:
        raise InputError(f"--input is not valid JSON: {exc.msg} at position {exc.pos}") from exc
    if not isinstance(run_input, dict):
        raise InputError("--input must be a JSON object")
    if args.at is not None and args.delay is not None:
        raise InputError("give either --at or --delay, not both")
    start_at = None if args.at is None else parse_instant(args.at, "--at")
    delay = _duration(args.delay, "--delay")
    deadline = _duration(args.deadline, "--deadline")
    priority = _priority(args.priority)
    with _client(args) as client:
        result = client.trigger(
            args.workflow,
            run_input,
            args.idempotency_key,
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            priority=priority,
        )
    output.line(str(result.run_id))
    return exitcodes.OK


def _priority(text: str | None) -> int | None:
    """``--priority`` as a whole number 0 to 9, None when absent; one line if bad."""
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]", text):
        raise InputError(f"--priority must be a whole number from 0 to 9, got {text!r}")
    return int(text)


def _duration(text: str | None, label: str) -> float | None:
    """Seconds of a duration option (``10m``), None when absent; one line naming it if bad."""
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise InputError(f"{label}: {exc}") from exc


def status(args: argparse.Namespace) -> int:
    timeout_s = wait.timeout_of(args)  # None: no --wait
    with _client(args) as client:
        outcome = wait.read(client, args.run_id, timeout_s)
    run = outcome.run
    if args.json:
        output.emit_json(output.run_dict(run))
        return wait.exit_code(outcome, timeout_s is not None)
    reason = f"  reason {run.failure_reason}" if run.failure_reason else ""
    output.line(f"run {run.id}  workflow {run.workflow}  state {run.state}{reason}")
    finished = f"{run.finished_at:%Y-%m-%d %H:%M:%S}" if run.finished_at else "-"
    output.line(f"created {run.created_at:%Y-%m-%d %H:%M:%S}  finished {finished}")
    timing = [
        f"{label} {value.isoformat(timespec='seconds')}"
        for label, value in (("start at", run.start_at), ("deadline", run.deadline_at))
        if value is not None
    ]
    if timing:
        output.line("  ".join(timing))
    if run.schedule is not None:
        fired = f"{run.fire_time:%Y-%m-%d %H:%M:%S}" if run.fire_time else "-"
        output.line(f"schedule {run.schedule}  fire time {fired}")
    if run.parent_run_id is not None:
        output.line(f"child of run {run.parent_run_id}  task run {run.parent_task_id}")
    if run.compensated:
        output.line(f"compensated: {', '.join(run.compensated)}")
    output.table(
        (
            "TASK",
            "STATE",
            "ATTEMPT",
            "REASON",
            "STARTED",
            "FINISHED",
            "SECONDS",
            "ID",
            "QUEUE",
            "WAITING_ON",
            "PROGRESS",
        ),
        [
            (
                t.name,
                t.state,
                t.attempt,
                _task_reason(t),
                t.started_at,
                t.finished_at,
                output.task_dict(t)["duration_s"],
                t.id,
                t.queue,
                t.waiting_on,
                progress_text(t.progress),
            )
            for t in run.tasks
        ],
    )
    return wait.exit_code(outcome, timeout_s is not None)


def progress_text(progress: Progress | None) -> str | None:
    """The PROGRESS column: ``40% message`` (the message is the handler's: the table escapes
    it); None when the current attempt reported none."""
    if progress is None:
        return None
    return f"{progress.fraction * 100:.0f}% {progress.message}".rstrip()


def _task_reason(task: TaskRun) -> str | None:
    """The REASON column: the failure reason, when a sleeping durable timer wakes, or what a
    waiting task waits for and until when; for a map task, also its items counted by state;
    for a child-workflow task, its latest attempt's child run (not once it waits again: a
    requeue or rerun starts a new one)."""
    if task.child_run_id is not None and task.state != TaskState.PENDING:
        child = f"child run {task.child_run_id} ({task.child_workflow})"
        reason = None if task.failure_reason is None else str(task.failure_reason)
        return child if reason is None else f"{reason}; {child}"
    if task.state == TaskState.RUNNING and task.event_name is not None:
        until = (
            "" if task.wake_at is None else f" until {task.wake_at.isoformat(timespec='seconds')}"
        )
        return f"waits for event {task.event_name} key {task.event_key!r}{until}"
    if task.state == TaskState.RUNNING and task.wake_at is not None:
        return f"sleeps until {task.wake_at.isoformat(timespec='seconds')}"
    if task.skipped:  # a run_if skip: say why, not "cancelled"
        if task.run_if == "all_succeeded":
            return "skipped: a dependency was skipped"
        return f"skipped: run_if {task.run_if} not met"
    if task.state == TaskState.PENDING and task.run_if != "all_succeeded":
        return f"run_if {task.run_if}"
    reason = None if task.failure_reason is None else str(task.failure_reason)
    if task.item_counts is not None and task.state != TaskState.PENDING:
        items = maps.summary(task.item_counts)
        return items if reason is None else f"{reason}; {items}"
    return reason


def runs(args: argparse.Namespace) -> int:
    state = args.state.upper() if args.state else None
    if state is not None and state not in RunState.__members__:
        raise InputError(f"--state must be one of {', '.join(RunState)}")
    if not 1 <= args.limit <= 1000:
        raise InputError("--limit must be between 1 and 1000")
    with _store(args) as store:
        found = store.list_runs(state=state, workflow=args.workflow, limit=args.limit)
    if args.json:
        output.emit_json([output.run_dict(r, with_tasks=False) for r in found])
        return exitcodes.OK
    output.table(
        ("ID", "WORKFLOW", "STATE", "CREATED", "FINISHED"),
        [(r.id, r.workflow, r.state, r.created_at, r.finished_at) for r in found],
    )
    return exitcodes.OK


def cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.cancel(args.run_id)
    if args.json:
        output.emit_json(output.run_dict(run))
    elif run.finished_at is None:  # tasks still executing were only asked to stop
        running = sum(t.state == TaskState.RUNNING for t in run.tasks)
        print(f"run {run.id} is {run.state}: cancel requested, {running} running task(s) to stop")
    else:
        output.line(f"run {run.id} is {run.state}")
    return exitcodes.OK


def dead_list(args: argparse.Namespace) -> int:
    from flowforge.domain.model import DeadFilter

    if not 1 <= args.limit <= MAX_DEAD_LIST:
        raise InputError(f"--limit must be between 1 and {MAX_DEAD_LIST}")
    reason = args.reason.lower() if args.reason else None
    if reason is not None and reason not in set(FailureReason):
        raise InputError(f"--reason must be one of {', '.join(FailureReason)}")
    match = DeadFilter(
        reason=FailureReason(reason) if reason else None,
        workflow=args.workflow,
        handler=args.task_handler,
    )
    with _store(args) as store:
        dead = store.list_dead(args.limit, match=match)
    if args.json:
        output.emit_json([output.task_dict(t) for t in dead])
        return exitcodes.OK
    output.table(
        ("ID", "RUN", "TASK", "HANDLER", "ATTEMPT", "REASON", "FINISHED"),
        [
            (t.id, t.run_id, t.name, t.handler, t.attempt, t.failure_reason, t.finished_at)
            for t in dead
        ],
    )
    return exitcodes.OK


#: ``dead list --limit``: at most this many (the API's page bound).
MAX_DEAD_LIST = 500


def dead_show(args: argparse.Namespace) -> int:
    with _store(args) as store:
        task = store.get_task(args.task_run_id)
        attempts = store.attempts(task.id)
    if args.json:
        output.emit_json(
            {**output.task_dict(task), "attempts": [output.attempt_dict(a) for a in attempts]}
        )
        return exitcodes.OK
    output.line(
        f"task run {task.id}  {task.name} ({task.handler})  state {task.state}  "
        f"reason {task.failure_reason or '-'}"
    )
    output.table(
        ("ATTEMPT", "WORKER", "OUTCOME", "REASON", "STARTED", "FINISHED", "ERROR"),
        [
            (
                a.attempt,
                a.worker,
                a.outcome,
                a.failure_reason,
                a.started_at,
                a.finished_at,
                output.first_line(a.error),
            )
            for a in attempts
        ],
    )
    if args.full:
        for a in attempts:
            for what, text in (("error", a.error), ("traceback", a.traceback)):
                if text:
                    print()
                    output.line(f"attempt {a.attempt} {what}:")
                    output.block(text)
    return exitcodes.OK


def dead_requeue(args: argparse.Namespace) -> int:
    with _client(args) as client:
        task = client.requeue(args.task_run_id, args.by or getpass.getuser(), args.reason)
    output.line(f"task run {task.id} requeued: {task.state}")
    return exitcodes.OK


def rerun(args: argparse.Namespace) -> int:
    with _client(args) as client:
        done = client.rerun(
            args.run_id, args.by or getpass.getuser(), args.reason, getattr(args, "from")
        )
    if args.json:
        output.emit_json(
            {
                "run": output.run_dict(done.run),
                "previous_state": done.previous_state,
                "task_run_ids": list(done.task_ids),
                "task_names": list(done.task_names),
            }
        )
        return exitcodes.OK
    output.line(
        f"run {done.run.id} ({done.previous_state}) rerun: {len(done.task_names)} task(s) "
        f"reset: {', '.join(done.task_names)}; now {done.run.state}"
    )
    return exitcodes.OK


def workflows_list(args: argparse.Namespace) -> int:
    from flowforge.client import Client

    workflows = Client(_config(args)).workflows
    if args.json:
        output.emit_json([wf.to_dict() for wf in workflows.values()])
        return exitcodes.OK
    output.table(
        ("WORKFLOW", "TASKS", "FAIL FAST", "DIGEST"),
        [(wf.name, len(wf.tasks), wf.fail_fast, wf.digest[:12]) for wf in workflows.values()],
    )
    return exitcodes.OK


def workflows_validate(args: argparse.Namespace) -> int:
    """Every problem of every file, one line each on stderr (exit 2), or a one-line summary.

    Task handlers are checked against what the configured ``handlers`` modules register:
    they are imported, as a worker would; and each task against the pool of this tree that
    consumes its queue, if one does (:func:`~flowforge.definitions.pool_problems`).
    """
    config = _config(args)
    paths = tuple(Path(p) for p in args.paths) or None
    problems: list[str] = []
    handlers: Collection[str] | None = None
    try:
        handlers = collect(config.handlers, config.base_dir)
    except ConfigError as exc:  # reported, and the handler names cannot be checked
        problems.append(str(exc))
    found, more = check_config(config, handlers, paths)
    problems += more
    if handlers is not None and config.processes.pools:
        pools = {
            pool.queue: (
                f"processes.pools[{i}]",
                collect(pool.handlers, config.base_dir) if pool.handlers is not None else handlers,
            )
            for i, pool in enumerate(config.processes.pools)
        }
        problems += pool_problems(found, config.broker.queue, pools)
    for problem in problems:
        output.line(f"flowforge: {problem}", sys.stderr)
    if problems:
        return exitcodes.USAGE
    output.line(f"{len(found)} workflow(s) valid: {', '.join(sorted(found)) or '-'}")
    return exitcodes.OK


def stats(args: argparse.Namespace) -> int:
    if args.poison_threshold < 1:
        raise InputError("--poison-threshold must be at least 1")
    with _store(args) as store:
        data = store.stats(args.poison_threshold)
    if args.json:
        output.emit_json(output.stats_dict(data))
        return exitcodes.OK
    # above 100,000 task runs the distribution is PostgreSQL's estimate (migration 0024)
    estimate = " (estimated: more than 100,000 task runs)" if data.attempts_estimated else ""
    output.line(f"attempts used per task run{estimate}:")
    output.table(("ATTEMPTS", "TASK RUNS"), sorted(data.attempts.items()))
    print()
    output.line("failure reasons (all attempts):")
    output.table(("REASON", "ATTEMPTS"), list(data.failure_reasons.items()))
    backlog = data.retry_backlog
    print()
    output.line(
        f"retry backlog: {backlog.n} waiting, next {backlog.next_at or '-'}, "
        f"latest {backlog.latest_at or '-'}"
    )
    print()
    output.line(f"poison candidates (>= {args.poison_threshold} attempts, unfinished):")
    output.table(
        ("ID", "WORKFLOW", "TASK", "STATE", "ATTEMPT", "REASON"),
        [
            (p.id, p.workflow, p.name, p.state, p.attempt, p.failure_reason)
            for p in data.poison_candidates
        ],
    )
    print()
    newest = data.dead_newest_only
    output.line(
        "dead tasks:"
        if newest is None
        else f"dead tasks (the newest {newest:,} counted; there are more):"
    )
    output.table(
        ("WORKFLOW", "HANDLER", "REASON", "COUNT"),
        [(d.workflow, d.handler, d.reason, d.n) for d in data.dead],
    )
    print()
    output.line("queues (READY tasks, live workers consuming):")
    output.table(
        ("QUEUE", "READY", "CONSUMERS", "WARNING"),
        [
            (
                q.queue,
                f"more than {q.ready - 1}" if q.estimated else q.ready,
                q.consumers,
                "no live consumer" if q.unserved else None,
            )
            for q in data.queues
        ],
    )
    return exitcodes.OK


def ps(args: argparse.Namespace) -> int:
    with _store(args) as store:
        found = store.list_processes()
    if args.json:
        output.emit_json([output.to_dict(p) for p in found])
        return exitcodes.OK
    output.table(
        ("HOST", "PID", "ROLE", "STARTED", "LAST SEEN", "SILENT S", "QUEUE"),
        [
            (p.host, p.pid, p.role, p.started_at, p.last_seen_at, round(p.silent_s, 1), p.queue)
            for p in found
        ],
    )
    return exitcodes.OK
