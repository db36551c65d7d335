"""The handler scripts/bench measures: it does nothing, so the engine is all that is timed."""

from __future__ import annotations

from typing import Any

from flowforge import task


@task("bench.noop")
def noop(ctx: Any) -> None:
    return None


@task("bench.items")
def items(ctx: Any) -> list[int]:
    """The list a map workload expands: ``[0, ..., input.n - 1]``."""
    return list(range(int(ctx.input["n"])))
