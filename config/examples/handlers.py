"""Handlers for the example workflows in ``config/workflows``.

Each takes the task context and returns a JSON-serialisable value; ``catalogue.import_file`` is
an ``async def`` handler.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flowforge import task


@task("hello.greet")
def greet(ctx: Any) -> dict[str, str]:
    return {"greeting": f"hello, {ctx.input.get('name', 'world')}"}


@task("payments.charge")
def charge(ctx: Any) -> dict[str, Any]:
    return {"charged": ctx.input["amount"], "order": ctx.input["order_id"]}


@task("inventory.reserve")
def reserve(ctx: Any) -> dict[str, Any]:
    return {"reserved": ctx.input.get("items", [])}


@task("shipping.ship")
def ship(ctx: Any) -> dict[str, Any]:
    return {"shipped": ctx.input["order_id"], "charge": ctx.upstream["charge"]}


@task("notify.email")
def email(ctx: Any) -> dict[str, Any]:
    return {"notified": ctx.input["customer_id"]}


@task("catalogue.list_files")
def list_files(ctx: Any) -> list[str]:
    return [f"{ctx.input['batch']}/part-{n}.csv" for n in range(ctx.input.get("files", 3))]


@task("catalogue.import_file")
async def import_file(ctx: Any) -> dict[str, Any]:
    """An ``async def`` handler (docs/handlers.md): a worker runs up to
    ``worker.async_concurrency`` of them at once on its event loop. The await stands for
    fetching the file; a cancelled run raises ``asyncio.CancelledError`` right here."""
    await asyncio.sleep(0.01)
    return {"file": ctx.item, "index": ctx.index, "rows": 100 + ctx.index}


@task("catalogue.undo")
def undo(ctx: Any) -> dict[str, Any]:
    return {"undone": ctx.input["batch"]}
