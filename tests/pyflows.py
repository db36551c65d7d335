"""Workflows defined in Python (``flowforge.Workflow``) for the tests of ``workflow_modules``
(tests/integration/test_workflows_python.py): listed in a config both as a workflow module and
as a handler module (its step records its executions like tests/e2e_handlers.py's)."""

from __future__ import annotations

from typing import Any

from flowforge import Workflow
from flowforge.roles.context import TaskContext
from tests.e2e_handlers import record

pipeline = Workflow("py-pipeline", deadline="10m")
first = pipeline.task("first", "e2e.record", idempotency_key="first-{n}")


@pipeline.step(depends_on=[first], retry={"max_attempts": 2, "base_delay": 0.1, "max_delay": 0.1})
def double(ctx: TaskContext) -> dict[str, Any]:
    record(ctx, "py-pipeline.double")
    return {"doubled": ctx.input["n"] * 2}


pipeline.task("pause", sleep=0.5, depends_on=[double])
pipeline.task("last", "e2e.record", depends_on=["pause"])

#: Fired by the scheduler every second: the scheduler sees Python-defined schedules.
ticking = Workflow("py-ticking")
ticking.task("tick", "e2e.record")
ticking.schedule(every="1s", name="py-tick", overlap="allow")
