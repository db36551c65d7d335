"""The falcon application: routes, the Host check, authentication, CSRF checks, the access
log, body limits, JSON errors."""

from __future__ import annotations

from collections.abc import Callable

import falcon

from flowforge.api import (
    control,
    dead,
    errors,
    events,
    gates,
    health,
    overview,
    runs,
    schedules,
    tasks,
)
from flowforge.api.graph import RunGraph
from flowforge.api.metrics import Metrics
from flowforge.api.security import AccessLog, CsrfGuard, HostCheck, SecurityHeaders, TokenAuth
from flowforge.api.timeline import RunTimeline
from flowforge.client import Client
from flowforge.config import ApiConfig
from flowforge.dashboard import pages
from flowforge.dashboard.graph import LayoutCache
from flowforge.errors import FlowForgeError
from flowforge.store.breakers import Gates
from flowforge.store.control import Control
from flowforge.store.maps import Maps
from flowforge.store.operator import Operator
from flowforge.store.processes import Processes
from flowforge.store.schedules import Schedules
from flowforge.store.timelines import Timelines


class ApiStatements(Operator, Processes, Schedules, Maps, Control, Gates, Timelines):
    """The api's part of the store: read models and the operator's actions (``Operator``
    answers with ``Reads``, its base), the process registry (``/api/v1/processes``) and the
    schedules (``/api/v1/schedules``).

    Runs are created through the :class:`Client`, which knows the workflows; the rest of the
    api reads and acts through these."""


Guard = AccessLog | SecurityHeaders | HostCheck | CsrfGuard | TokenAuth


def guards(token: str | None, api: ApiConfig) -> list[Guard]:
    """The middleware every request passes, in order: the Host check before anything, the
    CSRF checks before authentication (a forged request is refused, token or not); responses
    pass them in reverse order."""
    return [
        AccessLog(api.proxies()),
        SecurityHeaders(),
        HostCheck(api.hosts()),
        CsrfGuard(),
        TokenAuth(token, api.read_access),
    ]


def create_app(
    client: Client,
    token: str | None,
    api: ApiConfig,
    tree: Callable[[], dict[str, tuple[int, int]]] | None = None,
) -> falcon.App[falcon.Request, falcon.Response]:
    """The WSGI app: the JSON api, health, metrics and the dashboard pages.

    Only the ``api.hosts()`` may be addressed (health probes excepted). Every mutation must
    come from this origin (no cross-site request, no form body) and carry the bearer
    ``token``; so must every read of ``/api/...`` and ``/metrics`` unless ``api.read_access``
    is ``open``.
    """
    app = falcon.App(middleware=guards(token, api))
    app.req_options.strip_url_path_trailing_slash = True
    app.set_error_serializer(errors.serialize_error)
    app.add_error_handler(Exception, errors.handle_unexpected)
    app.add_error_handler(FlowForgeError, errors.handle_flowforge_error)
    store = ApiStatements(client.database)  # over the client's pool: one pool per process
    max_body = api.max_body_bytes
    app.add_route("/api/v1/runs", runs.Runs(client, store, max_body))
    app.add_route("/api/v1/runs:batch", runs.RunsBatch(client, max_body))
    app.add_route("/api/v1/runs/{run_id}", runs.OneRun(store))
    app.add_route("/api/v1/runs/{run_id}/cancel", runs.CancelRun(store))
    app.add_route("/api/v1/runs/{run_id}/rerun", runs.RerunRun(store, max_body))
    app.add_route("/api/v1/runs/{run_id}/graph", RunGraph(store, LayoutCache()))
    app.add_route("/api/v1/runs/{run_id}/timeline", RunTimeline(store))
    app.add_route("/api/v1/task-runs/{task_run_id}", tasks.TaskRunDetail(store))
    app.add_route("/api/v1/task-runs/{task_run_id}/items", tasks.MapItems(store))
    app.add_route("/api/v1/task-runs/{task_run_id}/logs", tasks.TaskRunLogs(store))
    app.add_route("/api/v1/task-runs/{task_run_id}/requeue", dead.Requeue(store, max_body))
    app.add_route("/api/v1/dead", dead.DeadTasks(store))
    app.add_route("/api/v1/dead/requeue", dead.BulkRequeue(store, max_body))
    app.add_route("/api/v1/overview", overview.Overview(store))
    app.add_route("/api/v1/processes", overview.Processes(store))
    schedules.add_routes(app, client, store)
    app.add_route("/api/v1/events", events.SendEvent(client, max_body))
    control.add_routes(app, store, max_body)
    gates.add_routes(app, store, max_body)
    app.add_route("/health/live", health.Live())
    ready = health.Ready(health.Checks(store, client.config.broker), tree, api.ready_cache_s)
    app.add_route("/health/ready", ready)
    app.add_route("/metrics", Metrics(store, store))
    pages.add_routes(app)
    return app
