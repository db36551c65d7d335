"""``async def`` handlers for the real-process tests of async handlers
(tests/integration/test_async_handlers_processes.py): a worker that imports only this module
has async handlers only, so it opens its window to ``worker.async_concurrency`` at once. Each
execution is recorded in ``test_executions`` like those of tests/e2e_handlers.py (in a thread:
the event loop must not block)."""

from __future__ import annotations

import asyncio
from typing import Any

from flowforge import task
from flowforge.roles.context import TaskContext
from tests.e2e_handlers import record


@task("e2e.async_sleep")
async def async_sleep(ctx: TaskContext) -> dict[str, Any]:
    """Awaits ``input.seconds`` (default 1). Cancelled (asyncio.CancelledError), it records a
    second row (handler ``e2e.async_sleep:cancelled``) and lets the cancellation through."""
    await asyncio.to_thread(record, ctx, "e2e.async_sleep")
    seconds = float(ctx.input.get("seconds", 1))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await asyncio.to_thread(record, ctx, "e2e.async_sleep:cancelled")
        raise
    return {"slept": seconds}
