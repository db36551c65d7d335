"""``GET /api/v1/task-runs/{task_run_id}``: one task run as an operator inspects it;
``GET /api/v1/task-runs/{task_run_id}/items``: a map task's items, counted then paged; and
``GET /api/v1/task-runs/{task_run_id}/logs``: what one of its attempts wrote."""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.domain.output import parse_attempt
from flowforge.domain.states import TaskState
from flowforge.store.maps import Maps
from flowforge.store.reads import Reads
from flowforge.views import attempt_dict, attempt_log_dict, map_page_dict, task_dict, to_dict

#: Items per page of ``GET /api/v1/task-runs/{id}/items`` unless ``?limit=`` says otherwise.
DEFAULT_PAGE = 100


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
    """``GET /api/v1/task-runs/{id}/items?state=&limit=&cursor=``: ``{"task", "counts",
    "items", "next_cursor"}`` for a map task (``for_each``). ``counts``: all its items by
    state; ``items``: up to ``limit`` (default 100, at most 500) of them in item order — in
    ``state`` only, if given — each ``{"id", "index", "state", "attempt", "failure_reason",
    "last_error", "item", "result", "idempotency_key", "started_at", "finished_at",
    "waiting_on"}``;
    ``next_cursor``: the ``cursor`` of the next page (null on the last), opaque as every
    cursor of the api. A malformed cursor, limit or state is a 400; a task run that is not a
    map a 404."""

    def __init__(self, maps: Maps) -> None:
        self._maps = maps

    def on_get(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        page = self._maps.map_page(
            task_run_id,
            cursor=req.get_param("cursor"),
            limit=params.limit(req, DEFAULT_PAGE),
            state=params.choice(req, "state", list(TaskState)),
        )
        params.send(resp, map_page_dict(page))


class TaskRunLogs:
    """``GET /api/v1/task-runs/{id}/logs?attempt=N``: what attempt N (default: the latest)
    captured — its ``ctx.log`` records, stdout and stderr, the tail of
    ``worker.log_capture_bytes`` — as ``{"task_run_id", "task_state", "attempt", "attempts",
    "outcome", "started_at", "finished_at", "running", "output", "dropped_bytes",
    "total_bytes"}`` (``attempt`` null and ``output`` empty before the first attempt). The
    output is the handler's untrusted text, as JSON escapes it: a page must escape it again.
    A malformed id or attempt is a 400; an unknown task run or attempt a 404."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def on_get(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        attempt = parse_attempt(req.get_param("attempt"))  # a bad one: InputError, a 400
        params.send(resp, attempt_log_dict(self._reads.attempt_log(task_run_id, attempt)))
