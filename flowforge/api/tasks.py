"""``GET /api/v1/task-runs/{task_run_id}``: one task run as an operator inspects it; and
``GET /api/v1/task-runs/{task_run_id}/items``: a map task's items, counted then paged."""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.store.maps import Maps
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


class MapItems:
    """``{"task", "counts", "items", "next_after"}`` for a map task (``for_each``): ``counts``
    its items by state, ``items`` up to ``?limit=`` (default 100, at most 500) of them in item
    order after item index ``?after=`` (default -1: from the first), each ``{"id", "index",
    "state", "attempt", "failure_reason", "last_error", "item", "result", "idempotency_key",
    "started_at", "finished_at"}``; ``next_after``: the ``after`` of the next page (null on the
    last). 404 for a task run that is not a map."""

    def __init__(self, maps: Maps) -> None:
        self._maps = maps

    def on_get(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        raw = req.get_param("after")
        if raw is not None and not (raw == "-1" or (raw.isascii() and raw.isdigit())):
            raise json_error(falcon.HTTP_400, "after must be an item index (an integer >= -1)")
        after = -1 if raw is None else int(raw)
        if after > 2**31 - 1:
            raise json_error(falcon.HTTP_400, "after must be an item index (an integer >= -1)")
        page = self._maps.map_page(task_run_id, after, params.limit(req, 100))
        params.send(
            resp,
            {
                "task": task_dict(page.task),
                "counts": dict(page.counts),
                "items": to_dict(list(page.items)),
                "next_after": page.next_after,
            },
        )
