"""The tutorial's handlers (docs/tutorial.md): list the products, check each one's price (an
``async def`` handler, run once per product by a map), report.

Listed in the config's ``handlers:``; a worker imports this module and runs only what it marks
with ``@task``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any

from flowforge import PermanentError, TaskContext, task

SKU = re.compile(r"[a-z][a-z0-9-]{0,39}")


@task("pricewatch.list_products")
def list_products(ctx: TaskContext) -> list[dict[str, str]]:
    """The products to check, from the run input's ``skus``: a JSON list, one map item each."""
    skus = ctx.input.get("skus")
    if not isinstance(skus, list) or not skus:
        raise PermanentError("the input needs 'skus': a non-empty list")  # no retry can help
    bad = [sku for sku in skus if not isinstance(sku, str) or not SKU.fullmatch(sku)]
    if bad:
        raise PermanentError(f"not a sku: {bad[0]!r}")
    ctx.log.info("checking %d products", len(skus))
    return [{"sku": sku} for sku in skus]


@task("pricewatch.check_price")
async def check_price(ctx: TaskContext) -> dict[str, Any]:
    """One product's price (``ctx.item``), looked up while other items' lookups wait too."""
    sku = ctx.item["sku"]
    price = await fetch_price(sku)
    ctx.progress(1.0, f"{sku}: {price} cents")
    return {"sku": sku, "price_cents": price, "position": ctx.index}


async def fetch_price(sku: str) -> int:
    """A stand-in for a partner's HTTP api (a real one would ``await`` an ``httpx.AsyncClient``,
    docs/handlers.md): a price in cents that depends only on ``sku``."""
    await asyncio.sleep(0.01)
    return 100 + int.from_bytes(hashlib.sha256(sku.encode()).digest()[:2], "big") % 10_000


@task("pricewatch.report")
def report(ctx: TaskContext) -> dict[str, Any]:
    """The map's results (a list in item order) summed up: what the run's result shows."""
    prices = ctx.upstream["check_price"]
    cheapest = min(prices, key=lambda found: found["price_cents"])
    print(f"{len(prices)} prices checked for {ctx.input['store']}")  # kept with the attempt
    return {
        "store": ctx.input["store"],
        "checked": len(prices),
        "cheapest": cheapest["sku"],
        "total_cents": sum(found["price_cents"] for found in prices),
    }
