"""``flowforge items RUN_ID TASK`` (or ``flowforge items MAP_TASK_RUN_ID``): a map task's items,
counted by state, then a page of them in item order.

Prints the counts, a table (index, state, attempts, failure reason, the item as JSON — escaped
and cut to :data:`ITEM_WIDTH` characters — and the item's task run id), and the cursor of the
next page (``--cursor``). ``--json``: the API's page (``GET /api/v1/task-runs/{id}/items``).
Bad flags are one line naming them, exit 2, checked before anything connects; an unknown run,
a task the run does not have or a task that is not a map, exit 5.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from flowforge.cli import exitcodes, output
from flowforge.config import load_config
from flowforge.domain import maps
from flowforge.errors import NotFoundError
from flowforge.views import map_page_dict

if TYPE_CHECKING:
    from uuid import UUID

    from flowforge.client import Client
    from flowforge.domain.model import MapPage

#: Items a page shows unless --limit says otherwise.
DEFAULT_LIMIT = 50
#: The widest an item's JSON is shown in the table (characters, the ellipsis included).
ITEM_WIDTH = 40


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``items`` on the ``flowforge`` subcommands (``sub``)."""
    p = sub.add_parser(
        "items", help="a map task's items: counts by state, then a page", parents=[common]
    )
    p.set_defaults(handler=items)
    p.add_argument("id", metavar="RUN_ID", help="the run (or, alone, the map's task run id)")
    p.add_argument("task", nargs="?", default=None, metavar="TASK", help="the map task's name")
    p.add_argument("--state", default=None, help="only the items in this task state")
    p.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help=f"items per page ({DEFAULT_LIMIT})"
    )
    p.add_argument("--cursor", default=None, help="the next page: the cursor a page printed")
    p.add_argument("--json", action="store_true", help="print JSON")


def _client(args: argparse.Namespace) -> Client:
    from flowforge.client import Client  # the database layer only for a valid command line

    return Client(load_config(getattr(args, "config", None)))


def items(args: argparse.Namespace) -> int:
    # every flag is judged before anything connects: a typo costs no database round trip
    state = maps.item_state(args.state, "--state")
    limit = maps.page_limit(args.limit, "--limit")
    if args.cursor is not None:
        maps.cursor_index(args.cursor, "--cursor")
    with _client(args) as client:
        task_run_id = args.id if args.task is None else _map_id(client, args.id, args.task)
        page = client.map_items(task_run_id, state=state, limit=limit, cursor=args.cursor)
    if args.json:
        output.emit_json(map_page_dict(page))
        return exitcodes.OK
    _print(page)
    return exitcodes.OK


def _map_id(client: Client, run_id: str, name: str) -> UUID:
    """The id of task ``name`` of run ``run_id``; NotFoundError if the run has none."""
    run = client.status(run_id)
    for task in run.tasks:
        if task.name == name:
            return task.id
    raise NotFoundError(f"run {run.id} has no task {name!r}")


def _print(page: MapPage) -> None:
    task = page.task
    output.line(
        f"map {task.name} (task run {task.id})  for each of {task.for_each}  state {task.state}"
    )
    output.line(maps.summary(page.counts))
    output.table(
        ("INDEX", "STATE", "ATTEMPT", "REASON", "ITEM", "ID"),
        [
            (i.index, i.state, i.attempt, i.failure_reason, item_text(i.item), i.id)
            for i in page.items
        ],
    )
    if page.next_cursor is None:
        output.line("last page")
    else:
        output.line(f"next page: --cursor {page.next_cursor}")


def item_text(item: Any, width: int = ITEM_WIDTH) -> str:
    """An item as one line of JSON cut to ``width`` characters (``…`` marks a cut). Not escaped
    here: the table escapes every cell (a control character becomes visible, never obeyed)."""
    text = json.dumps(item, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"
