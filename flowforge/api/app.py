"""The falcon application: routes, authentication, body limits, JSON errors."""

from __future__ import annotations

from collections.abc import Callable

import falcon

from flowforge.api import errors, health, runs
from flowforge.api.metrics import Metrics
from flowforge.api.security import TokenAuth
from flowforge.client import Client
from flowforge.errors import FlowForgeError


def create_app(
    client: Client,
    token: str | None,
    max_body: int,
    tree: Callable[[], dict[str, tuple[int, int]]] | None = None,
) -> falcon.App[falcon.Request, falcon.Response]:
    """The WSGI app. Reads are open; every mutation needs the bearer ``token``."""
    app = falcon.App(middleware=[TokenAuth(token)])
    app.req_options.strip_url_path_trailing_slash = True
    app.set_error_serializer(errors.serialize_error)
    app.add_error_handler(Exception, errors.handle_unexpected)
    app.add_error_handler(FlowForgeError, errors.handle_flowforge_error)
    repo = client.repository
    app.add_route("/api/v1/runs", runs.Runs(client, max_body))
    app.add_route("/api/v1/runs/{run_id}", runs.OneRun(client))
    app.add_route("/api/v1/runs/{run_id}/cancel", runs.CancelRun(client))
    app.add_route("/api/v1/dead", runs.DeadTasks(client))
    app.add_route("/api/v1/task-runs/{task_run_id}/requeue", runs.Requeue(client, max_body))
    app.add_route("/health/live", health.Live())
    app.add_route("/health/ready", health.Ready(repo, client.config.broker, tree))
    app.add_route("/metrics", Metrics(repo))
    return app
