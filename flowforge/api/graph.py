"""``GET /api/v1/runs/{run_id}/graph``: the run's DAG laid out for drawing, with task states.

The layout (flowforge/dashboard/graph.py) depends only on the DAG's shape, so it is cached by
shape; the states are read fresh on every request.
"""

from __future__ import annotations

from typing import Any

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.dashboard.graph import EdgePath, LayoutCache, TooLargeError
from flowforge.domain.model import TaskRun
from flowforge.store.reads import Reads
from flowforge.views import run_dict


class RunGraph:
    """``{"run", "width", "height", "nodes", "edges"}``.

    A node is ``{"name", "label", "x", "y", "width", "height", "task_id", "state", "handler",
    "attempt", "max_attempts", "failure_reason", "sleep_s", "wake_at", "event_name",
    "event_key"}`` (x, y: the top-left corner; ``sleep_s``/``wake_at``: a durable timer's sleep
    and wake time, else null; ``event_name``/``event_key``: what a ``wait_for_event`` task waits
    for, its ``wake_at`` then its timeout, else null; ``for_each``/``item_counts``: a map task's
    upstream and its items counted by state — one node however many items:
    ``GET /api/v1/task-runs/{id}/items`` pages them); an edge is
    ``{"from", "to", "points": [[x, y], ...], "path"}`` (``path``: the SVG path data).
    """

    def __init__(self, reads: Reads, cache: LayoutCache) -> None:
        self._reads = reads
        self._cache = cache

    def on_get(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        run = self._reads.get_run(run_id)
        try:
            drawn = self._cache.get([(t.name, t.depends_on) for t in run.tasks])
        except TooLargeError as exc:
            raise json_error(falcon.HTTP_422, str(exc)) from exc
        tasks = {t.name: t for t in run.tasks}
        params.send(
            resp,
            {
                "run": run_dict(run, with_tasks=False),
                "width": drawn.width,
                "height": drawn.height,
                "nodes": [
                    {
                        "name": box.name,
                        "label": box.label,
                        "x": box.x,
                        "y": box.y,
                        "width": box.width,
                        "height": box.height,
                        **_task_facts(tasks[box.name]),
                    }
                    for box in drawn.nodes
                ],
                "edges": [_edge_dict(e) for e in drawn.edges],
            },
        )


def _task_facts(task: TaskRun) -> dict[str, Any]:
    return {
        "task_id": task.id,
        "state": task.state,
        "handler": task.handler,
        "attempt": task.attempt,
        "max_attempts": task.max_attempts,
        "failure_reason": task.failure_reason,
        "sleep_s": task.sleep_s,
        "wake_at": task.wake_at,
        "for_each": task.for_each,
        "item_counts": task.item_counts,
        "event_name": task.event_name,
        "event_key": task.event_key,
        "child_workflow": task.child_workflow,
        "child_run_id": task.child_run_id,
    }


def _edge_dict(edge: EdgePath) -> dict[str, Any]:
    first, *rest = edge.points
    path = f"M{first[0]},{first[1]}" + "".join(f" L{x},{y}" for x, y in rest)
    return {
        "from": edge.source,
        "to": edge.target,
        "points": [list(p) for p in edge.points],
        "path": path,
    }
