"""``flowforge purge --dead --older-than AGE``: the operator's way to drop old dead tasks.

Retention never deletes a DEAD task (docs/operations.md, "Retention"): it waits for a requeue or
for this command. A dead task goes with its whole run — tasks, attempts, edges, requeue audit —
and only when nothing else in the run can still change; idempotency keys stay. Deleting a dead
``on_dead: block`` task releases the ordering stream it held: the output says how many. Each
batch is one transaction with a ``purge_audit`` row (who, when, what, which streams).
"""

from __future__ import annotations

import argparse
import getpass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain.model import DeadPurge
from flowforge.durations import parse_duration
from flowforge.errors import InputError

if TYPE_CHECKING:
    from flowforge.store.operator import Operator

#: Runs per batch (one transaction each) unless --batch-size says otherwise.
DEFAULT_BATCH = 500
#: Dead tasks a dry run lists (the counts are always complete).
DRY_RUN_SHOWN = 100


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``purge`` on the ``flowforge`` subcommands (``sub``), with the common options."""
    p = sub.add_parser(
        "purge",
        help="delete dead tasks older than an age, with their runs (retention keeps them)",
        parents=[common],
    )
    p.set_defaults(handler=purge)
    p.add_argument("--dead", action="store_true", help="purge DEAD tasks (required)")
    p.add_argument(
        "--older-than",
        required=True,
        metavar="AGE",
        help="died more than AGE ago by the database clock: 90d, 12h, 30m, 45s",
    )
    p.add_argument("--workflow", default=None, help="only dead tasks of this workflow")
    p.add_argument("--dry-run", action="store_true", help="count and list, delete nothing")
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help=f"runs per transaction ({DEFAULT_BATCH})",
    )
    p.add_argument("--by", default=None, help="who purges, for the audit row (default: OS user)")
    p.add_argument("--json", action="store_true", help="print JSON")


def purge(args: argparse.Namespace) -> int:
    if not args.dead:
        raise InputError("say what to purge: --dead (the only kind there is)")
    try:
        age_s = parse_duration(args.older_than)
    except ValueError as exc:
        raise InputError(f"--older-than: {exc}") from None
    if args.batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    from flowforge.cli.statements import opened  # the database layer only for a valid command line

    with opened(load_config(getattr(args, "config", None))) as operator:
        if args.dry_run:
            total = operator.preview_dead_purge(age_s, args.workflow, show=DRY_RUN_SHOWN)
            batches = 0
            kept = operator.count_old_dead(age_s, args.workflow) - len(total.dead_task_ids)
        else:
            total, batches = _purge_all(operator, args, age_s)
            kept = operator.count_old_dead(age_s, args.workflow)
    report = {
        "dry_run": args.dry_run,
        "older_than_s": age_s,
        "workflow": args.workflow,
        "runs": total.runs,
        "tasks": total.tasks,
        "dead_tasks": len(total.dead_task_ids),
        "streams_released": len(total.released_streams),
        "released_streams": list(total.released_streams),
        "kept": kept,
        "batches": batches,
    }
    if args.json:
        output.emit_json({**report, "shown": list(total.shown)} if args.dry_run else report)
    else:
        _print_report(args, report, total)
    return exitcodes.OK


def _purge_all(operator: Operator, args: argparse.Namespace, age_s: float) -> tuple[DeadPurge, int]:
    """Batch after batch until one finds nothing; the sums of every batch, and their count."""
    by = args.by or getpass.getuser()
    runs = tasks = batches = 0
    dead: list[UUID] = []
    streams: set[str] = set()
    while (batch := operator.purge_dead(age_s, by, args.batch_size, args.workflow)).runs:
        batches += 1
        runs, tasks = runs + batch.runs, tasks + batch.tasks
        dead += batch.dead_task_ids
        streams.update(batch.released_streams)
    return DeadPurge(runs, tasks, tuple(dead), tuple(sorted(streams))), batches


def _print_report(args: argparse.Namespace, report: dict[str, Any], total: DeadPurge) -> None:
    scope = f" of workflow {args.workflow!r}" if args.workflow else ""
    verb = "dry run: would purge" if args.dry_run else "purged"
    output.line(
        f"{verb} {report['dead_tasks']} dead task(s){scope} older than {args.older_than} "
        f"in {report['runs']} run(s) ({report['tasks']} task run(s) in all)"
        + ("" if args.dry_run else f", {report['batches']} batch(es)")
    )
    released = "would release" if args.dry_run else "released"
    output.line(
        f"{released} {report['streams_released']} ordering stream(s) held by on_dead: block "
        "(their next tasks can now run; --json lists them)"
    )
    if report["kept"]:
        output.line(
            f"kept {report['kept']} dead task(s) as old whose run still has work that can "
            "change: cancel the run, or requeue, first"
        )
    if args.dry_run and total.shown:
        output.table(
            ("ID", "RUN", "WORKFLOW", "TASK", "REASON", "DIED"),
            [
                (
                    t["id"],
                    t["run_id"],
                    t["workflow"],
                    t["name"],
                    t["failure_reason"],
                    datetime.fromisoformat(t["finished_at"]),
                )
                for t in total.shown
            ],
        )
        if len(total.shown) < report["dead_tasks"]:
            output.line(f"... and {report['dead_tasks'] - len(total.shown)} more")
