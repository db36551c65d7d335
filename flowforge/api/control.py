"""Control of one task: ``POST /api/v1/task-runs/{id}/cancel``, ``.../retry-now``, ``.../bury``
(each with an optional ``{"reason", "requested_by"}``, audited), and ``GET /api/v1/keys?key=``:
what holds a key. A refusal is a 409 naming the task's state, an unknown task a 404, a bad id,
body or key a 400; a refusal changes and audits nothing."""

from __future__ import annotations

from collections.abc import Callable

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.api.security import read_json
from flowforge.domain.control import Controlled
from flowforge.store.control import Control
from flowforge.views import controlled_dict, key_holds_dict

#: What the body of an audited action on one task may hold.
NOTE_FIELDS = frozenset({"reason", "requested_by"})
#: ``requested_by`` when the body names nobody.
API_REQUESTER = "api"

Act = Callable[[str, str, "str | None"], Controlled]


def note(req: falcon.Request, max_body: int) -> tuple[str, str | None]:
    """``(requested_by, reason)`` of an optional ``{"reason", "requested_by"}`` body (a
    requeue's, a cancel's, ...): strings PostgreSQL can store, else a 400 naming the field."""
    body = read_json(req, max_body, required=False) or {}
    if not isinstance(body, dict) or set(body) - NOTE_FIELDS:
        raise json_error(falcon.HTTP_400, "the body may only hold 'reason' and 'requested_by'")
    reason, by = body.get("reason"), body.get("requested_by", API_REQUESTER)
    if not (reason is None or isinstance(reason, str)) or not isinstance(by, str):
        raise json_error(falcon.HTTP_400, "'reason' and 'requested_by' must be strings")
    params.storable(by, "requested_by")
    if reason is not None:
        params.storable(reason, "reason")
    return by, reason


class TaskAction:
    """``POST /api/v1/task-runs/{task_run_id}/<action>``: ``{"action", "previous_state",
    "effect", "task"}`` (``effect`` ``stop``: a worker executes it; it was asked to stop)."""

    def __init__(self, act: Act, max_body: int) -> None:
        self._act = act
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        by, reason = note(req, self._max_body)
        params.send(resp, controlled_dict(self._act(task_run_id, by, reason)))


class Keys:
    """``GET /api/v1/keys?key=K``: ``{"key", "holds": [{"kind", "limit", "holders",
    "waiting", "next"}]}`` (see :func:`~flowforge.views.key_holds_dict`)."""

    def __init__(self, control: Control) -> None:
        self._control = control

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        key = req.get_param("key")
        if not key:
            raise json_error(falcon.HTTP_400, "?key= is required: the key to look up")
        params.storable(key, "key")  # its length the store judges (a 400 too)
        params.send(resp, key_holds_dict(key, self._control.key_holds(key)))


def add_routes(
    app: falcon.App[falcon.Request, falcon.Response], control: Control, max_body: int
) -> None:
    """The routes of this module."""
    for path, act in (
        ("cancel", control.cancel_task),
        ("retry-now", control.retry_task_now),
        ("bury", control.bury_task),
    ):
        app.add_route(f"/api/v1/task-runs/{{task_run_id}}/{path}", TaskAction(act, max_body))
    app.add_route("/api/v1/keys", Keys(control))
