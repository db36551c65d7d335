"""``/api/v1/schedules``: list schedules, one with its recent decisions, pause, resume and
trigger (SPEC 7.2).

A schedule's name is ``workflow/index`` unless the file gives one (which has no slash), so a
name has at most one ``/``; a client may send it as is or encoded (``%2F``): the server
decodes the path before routing, so both arrive as two segments, and each route has a
two-segment twin that joins them.
"""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.client import Client
from flowforge.store.schedules import Schedules
from flowforge.views import fire_dict, manual_fire_dict, schedule_dict

#: Decisions ``GET /api/v1/schedules/{name}`` shows unless ``?limit=`` says otherwise.
HISTORY = 20
#: Schedules per page of ``GET /api/v1/schedules`` unless ``?limit=`` says otherwise.
DEFAULT_PAGE = 100


def _joined(name: str, index: str | None) -> str:
    return name if index is None else f"{name}/{index}"


class ScheduleList:
    """``GET /api/v1/schedules?limit=&cursor=``: ``{"schedules": [...], "next_cursor"}``, a
    page by name; ``next_cursor`` (the page's last name, or null on the last page) asks for
    the next one."""

    def __init__(self, schedules: Schedules) -> None:
        self._schedules = schedules

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        limit = params.limit(req, DEFAULT_PAGE)
        found = self._schedules.list_schedules(after=params.text(req, "cursor"), limit=limit + 1)
        page = found[:limit]
        more = len(found) > limit
        params.send(
            resp,
            {
                "schedules": [schedule_dict(s) for s in page],
                "next_cursor": page[-1].name if more else None,
            },
        )


class OneSchedule:
    """``GET /api/v1/schedules/{name}?limit=``: the schedule and its latest decisions
    (``history``, newest first)."""

    def __init__(self, schedules: Schedules) -> None:
        self._schedules = schedules

    def on_get(
        self, req: falcon.Request, resp: falcon.Response, name: str, index: str | None = None
    ) -> None:
        name = _joined(name, index)
        info = self._schedules.get_schedule(name)
        history = self._schedules.fire_history(name, params.limit(req, HISTORY))
        params.send(resp, {**schedule_dict(info), "history": [fire_dict(f) for f in history]})


class PauseSchedule:
    """``POST /api/v1/schedules/{name}/pause``: the schedule after."""

    def __init__(self, schedules: Schedules) -> None:
        self._schedules = schedules

    def on_post(
        self, _req: falcon.Request, resp: falcon.Response, name: str, index: str | None = None
    ) -> None:
        params.send(resp, schedule_dict(self._schedules.pause_schedule(_joined(name, index))))


class ResumeSchedule:
    """``POST /api/v1/schedules/{name}/resume``: the schedule after."""

    def __init__(self, schedules: Schedules) -> None:
        self._schedules = schedules

    def on_post(
        self, _req: falcon.Request, resp: falcon.Response, name: str, index: str | None = None
    ) -> None:
        params.send(resp, schedule_dict(self._schedules.resume_schedule(_joined(name, index))))


class TriggerSchedule:
    """``POST /api/v1/schedules/{name}/trigger``: 201 with ``{"schedule", "run_id",
    "fire_time"}`` and the run's ``Location``. Through the :class:`Client`, which knows the
    workflows."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def on_post(
        self, _req: falcon.Request, resp: falcon.Response, name: str, index: str | None = None
    ) -> None:
        fired = self._client.trigger_schedule(_joined(name, index))
        resp.set_header("Location", f"/api/v1/runs/{fired.run_id}")
        params.send(resp, manual_fire_dict(fired), falcon.HTTP_201)


def add_routes(
    app: falcon.App[falcon.Request, falcon.Response], client: Client, schedules: Schedules
) -> None:
    """The schedule routes, each with its two-segment twin for ``workflow/index`` names."""
    app.add_route("/api/v1/schedules", ScheduleList(schedules))
    for suffix, resource in (
        ("", OneSchedule(schedules)),
        ("/pause", PauseSchedule(schedules)),
        ("/resume", ResumeSchedule(schedules)),
        ("/trigger", TriggerSchedule(client)),
    ):
        app.add_route(f"/api/v1/schedules/{{name}}{suffix}", resource)
        app.add_route(f"/api/v1/schedules/{{name}}/{{index}}{suffix}", resource)
