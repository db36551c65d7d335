"""Circuit breakers and pauses (SPEC 7.4): ``GET /api/v1/breakers``,
``POST /api/v1/breakers/{handler}/open`` and ``.../close``, ``GET /api/v1/pauses``,
``POST /api/v1/queues/{name}/pause`` and ``.../resume``, ``POST /api/v1/handlers/{name}/pause``
and ``.../resume`` — each action with an optional ``{"reason", "requested_by"}`` body, audited.
A keyed breaker (``circuit_breaker.key``) is named by the query parameter ``key`` — on the
list (a filter, with ``handler``) and on ``open``/``close`` (absent: the handler's own
breaker); a query parameter rather than a body field so the list and the actions name it alike
and the body stays the audit note every action takes. A bad name, key or body is a 400, a
handler no workflow names a 404, a state that refuses the action a 409; a refusal changes and
audits nothing."""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.api.control import note
from flowforge.store.breakers import Gates
from flowforge.views import breaker_dict, gate_change_dict, pause_dict


class Breakers:
    """``GET /api/v1/breakers[?handler=H][&key=K]``: ``{"breakers": [...]}``, one per breaker
    row (a handler's, ``key`` ``""``; or one key's of a handler)."""

    def __init__(self, gates: Gates) -> None:
        self._gates = gates

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        found = self._gates.breakers(req.get_param("handler"), req.get_param("key"))
        params.send(resp, {"breakers": [breaker_dict(b) for b in found]})


class BreakerAction:
    """``POST /api/v1/breakers/{handler}/open|close[?key=K]``: ``{"action", "scope", "name",
    "key", "previous_state", "new_state"}`` (``key`` null: the handler's own breaker). An
    empty ``key`` is a 400, never the handler's breaker by accident."""

    def __init__(self, gates: Gates, action: str, max_body: int) -> None:
        self._gates = gates
        self._action = action
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, handler: str) -> None:
        by, reason = note(req, self._max_body)
        act = self._gates.open_breaker if self._action == "open" else self._gates.close_breaker
        params.send(resp, gate_change_dict(act(handler, by, reason, req.get_param("key"))))


class Pauses:
    """``GET /api/v1/pauses``: ``{"pauses": [...]}``, every paused queue and handler."""

    def __init__(self, gates: Gates) -> None:
        self._gates = gates

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        params.send(resp, {"pauses": [pause_dict(p) for p in self._gates.pauses()]})


class PauseAction:
    """``POST /api/v1/{queues|handlers}/{name}/pause|resume``: as :class:`BreakerAction`."""

    def __init__(self, gates: Gates, scope: str, action: str, max_body: int) -> None:
        self._gates = gates
        self._scope = scope
        self._action = action
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        by, reason = note(req, self._max_body)
        act = self._gates.pause if self._action == "pause" else self._gates.resume
        params.send(resp, gate_change_dict(act(self._scope, name, by, reason)))


def add_routes(
    app: falcon.App[falcon.Request, falcon.Response], gates: Gates, max_body: int
) -> None:
    """The routes of this module."""
    app.add_route("/api/v1/breakers", Breakers(gates))
    for action in ("open", "close"):
        route = f"/api/v1/breakers/{{handler}}/{action}"
        app.add_route(route, BreakerAction(gates, action, max_body))
    app.add_route("/api/v1/pauses", Pauses(gates))
    for scope in ("queue", "handler"):
        for action in ("pause", "resume"):
            route = f"/api/v1/{scope}s/{{name}}/{action}"
            app.add_route(route, PauseAction(gates, scope, action, max_body))
