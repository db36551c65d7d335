"""``GET /api/v1/runs/{run_id}/timeline``: where the run spent its time — its tasks and their
attempts on one time axis, for the run page's Gantt (docs/dashboard-contract.md "Timeline").

Bounded whatever the run's size (:class:`~flowforge.domain.timeline.TimelineLimits`): what is
left out is counted in a row of its own. Read fresh on every request (a running attempt's bar
ends at the database's now).
"""

from __future__ import annotations

from typing import Any

import falcon

from flowforge.api import params
from flowforge.dashboard.timeline import lay_out
from flowforge.domain.timeline import TimelineLimits
from flowforge.store.timelines import Timelines
from flowforge.views import to_dict

#: The run facts a timeline answers with (the rest is ``GET /api/v1/runs/{id}``'s).
RUN_KEYS = ("id", "workflow", "state", "created_at", "started_at", "finished_at", "start_at")


class RunTimeline:
    """``{"run", "now", "start", "end", "span_s", "rows", "ticks", "limits", "tasks_total"}``.

    ``run``: ``{"id", "workflow", "state", "created_at", "started_at", "finished_at",
    "start_at"}``; ``start``/``end``: the axis (``span_s`` seconds); ``rows``: top to bottom,
    each ``{"kind": "task" | "item" | "more" | "omitted", "key", "name", "label", "depth",
    "task_id", "map_id", "task_kind", "handler", "state", "failure_reason", "attempts",
    "attempts_omitted", "retry_at", "n", "counts", "segments"}``, a segment ``{"kind": "wait" |
    "attempt" | "backoff" | "span" | "items", "start", "end", "start_s", "end_s", "open",
    "attempt", "outcome", "failure_reason", "worker", "error"}`` (``error``: the first line of
    the attempt's error, untrusted text); ``ticks``: ``[{"s", "label"}]``. A malformed id is a
    400, an unknown run a 404.
    """

    def __init__(self, timelines: Timelines, limits: TimelineLimits | None = None) -> None:
        self._timelines = timelines
        self._limits = limits or TimelineLimits()

    def on_get(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        facts = self._timelines.timeline(run_id, self._limits)
        drawn = lay_out(facts)
        run = to_dict(facts.run)
        data: dict[str, Any] = {
            "run": {key: run[key] for key in RUN_KEYS},
            "now": drawn.now,
            "start": drawn.start,
            "end": drawn.end,
            "span_s": drawn.span_s,
            "rows": to_dict(list(drawn.rows)),
            "ticks": to_dict(list(drawn.ticks)),
            "limits": to_dict(self._limits),
            "tasks_total": facts.tasks_total,
        }
        params.send(resp, data)
