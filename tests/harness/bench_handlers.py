"""The handlers scripts/bench measures: ``bench.noop`` does nothing, so the engine is all that is
timed; ``bench.nap`` and ``bench.nap_async`` wait the same time, blocking and awaiting."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from flowforge import task


@task("bench.noop")
def noop(ctx: Any) -> None:
    return None


@task("bench.items")
def items(ctx: Any) -> list[int]:
    """The list a map workload expands: ``[0, ..., input.n - 1]``."""
    return list(range(int(ctx.input["n"])))


#: How long the nap handlers wait (seconds): scripts/bench's async against sync workload.
NAP_S = 0.05


@task("bench.nap")
def nap(ctx: Any) -> None:
    """Blocks its thread for NAP_S: a sync handler waiting on I/O."""
    time.sleep(NAP_S)


@task("bench.nap_async")
async def nap_async(ctx: Any) -> None:
    """Awaits NAP_S: the same wait in an async handler (the worker's event loop)."""
    await asyncio.sleep(NAP_S)


@task("bench.sleep")
def sleep(ctx: Any) -> None:
    """A handler that spends ``input.ms`` milliseconds away from the CPU, as one that waits
    on a remote service does."""
    time.sleep(float(ctx.input["ms"]) / 1000)


@task("bench.echo")
def echo(ctx: Any) -> dict[str, Any]:
    """Returns its input's ``blob``: a result as large as the input (scripts/bench --payloads)."""
    return {"blob": ctx.input["blob"]}
