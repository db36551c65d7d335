"""A handler module of its own for the queue tests (tests/integration/test_queues_processes.py):
a tree or pool that imports only this one cannot run ``e2e.record`` and the others of
tests/e2e_handlers.py, and one that imports only those cannot run ``e2e.partner``. Each
execution is recorded in ``test_executions`` like theirs."""

from __future__ import annotations

from typing import Any

from flowforge import task
from flowforge.roles.context import TaskContext
from tests.e2e_handlers import record


@task("e2e.partner")
def partner(ctx: TaskContext) -> dict[str, Any]:
    record(ctx, "e2e.partner")
    return {"task": ctx.name, "attempt": ctx.attempt}
