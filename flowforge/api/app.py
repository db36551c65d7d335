"""The falcon application: routes, the Host check, authentication, CSRF checks, the access
log, body limits, JSON errors."""

from __future__ import annotations

from collections.abc import Callable

import falcon

from flowforge.api import dead, errors, health, overview, runs, tasks
from flowforge.api.graph import RunGraph
from flowforge.api.metrics import Metrics
from flowforge.api.security import AccessLog, CsrfGuard, HostCheck, SecurityHeaders, TokenAuth
from flowforge.client import Client
from flowforge.config import ApiConfig
from flowforge.dashboard import pages
from flowforge.dashboard.graph import LayoutCache
from flowforge.errors import FlowForgeError


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
    # in order: the Host check before anything, the CSRF checks before authentication (a
    # forged request is refused, token or not); responses pass them in reverse order
    middleware: list[AccessLog | SecurityHeaders | HostCheck | CsrfGuard | TokenAuth] = [
        AccessLog(),
        SecurityHeaders(),
        HostCheck(api.hosts()),
        CsrfGuard(),
        TokenAuth(token, api.read_access),
    ]
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    app.set_error_serializer(errors.serialize_error)
    app.add_error_handler(Exception, errors.handle_unexpected)
    app.add_error_handler(FlowForgeError, errors.handle_flowforge_error)
    repo = client.repository
    max_body = api.max_body_bytes
    app.add_route("/api/v1/runs", runs.Runs(client, max_body))
    app.add_route("/api/v1/runs/{run_id}", runs.OneRun(client))
    app.add_route("/api/v1/runs/{run_id}/cancel", runs.CancelRun(client))
    app.add_route("/api/v1/runs/{run_id}/graph", RunGraph(client, LayoutCache()))
    app.add_route("/api/v1/task-runs/{task_run_id}", tasks.TaskRunDetail(client))
    app.add_route("/api/v1/task-runs/{task_run_id}/requeue", dead.Requeue(client, max_body))
    app.add_route("/api/v1/dead", dead.DeadTasks(client))
    app.add_route("/api/v1/dead/requeue", dead.BulkRequeue(client, max_body))
    app.add_route("/api/v1/overview", overview.Overview(client))
    app.add_route("/api/v1/processes", overview.Processes(client))
    app.add_route("/health/live", health.Live())
    ready = health.Ready(health.Checks(repo, client.config.broker), tree, api.ready_cache_s)
    app.add_route("/health/ready", ready)
    app.add_route("/metrics", Metrics(repo))
    pages.add_routes(app)
    return app
