"""The handler scripts/bench measures: it does nothing, so the engine is all that is timed."""

from __future__ import annotations

from typing import Any

from flowforge import task


@task("bench.noop")
def noop(ctx: Any) -> None:
    return None
