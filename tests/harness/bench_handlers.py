"""The handler scripts/bench measures: it does nothing, so the engine is all that is timed."""

from __future__ import annotations

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


@task("bench.sleep")
def sleep(ctx: Any) -> None:
    """A handler that spends ``input.ms`` milliseconds away from the CPU, as one that waits
    on a remote service does."""
    time.sleep(float(ctx.input["ms"]) / 1000)
