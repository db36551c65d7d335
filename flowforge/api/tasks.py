"""``GET /api/v1/task-runs/{task_run_id}``: one task run as an operator inspects it."""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.store.reads import Reads
from flowforge.views import attempt_dict, task_dict, to_dict


class TaskRunDetail:
    """``{"task", "workflow", "run_state", "input", "upstream", "result", "attempts", "audit"}``.

    ``input`` is the run input the handler was given, ``upstream`` the results of the tasks it
    depends on (by name), ``attempts`` every attempt (worker, times, outcome, failure reason,
    error, traceback) oldest first, ``audit`` every requeue (who, when, why).
    """

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def on_get(self, _req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        detail = self._reads.task_detail(task_run_id)
        params.send(
            resp,
            {
                "task": task_dict(detail.task),
                "workflow": detail.workflow,
                "run_state": detail.run_state,
                "input": detail.input,
                "upstream": detail.upstream,
                "result": detail.task.result,
                "attempts": [attempt_dict(a) for a in detail.attempts],
                "audit": to_dict(list(detail.audit)),
            },
        )
