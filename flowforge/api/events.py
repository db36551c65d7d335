"""``POST /api/v1/events``: send an event, waking the tasks that wait for it.

The body is ``{"name", "key", "data"}`` (``data`` optional, any JSON value). The answer is
201 with the stored event and the tasks it woke (``views.event_dict``). A bad body or field is
400 with one line naming it; nothing is stored.
"""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.api.security import read_json
from flowforge.client import Client
from flowforge.domain.events import check_event
from flowforge.views import event_dict

FIELDS = frozenset({"name", "key", "data"})


class SendEvent:
    """``POST /api/v1/events`` (a mutation: the token, like every other)."""

    def __init__(self, client: Client, max_body: int) -> None:
        self._client = client
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self._max_body)
        if not isinstance(body, dict):
            raise json_error(falcon.HTTP_400, "the body must be a JSON object")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise json_error(falcon.HTTP_400, f"unknown field {unknown[0]!r}")
        # the name and key checked here for their types too (they come as any JSON value)
        name, key, _ = check_event(body.get("name"), body.get("key"))
        sent = self._client.send_event(name, key, body.get("data"))
        params.send(resp, event_dict(sent), falcon.HTTP_201)
