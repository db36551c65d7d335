"""The api child: serves the falcon app with waitress until told to stop.

Like the other roles it has ``initialize / loop / reset / shutdown``; it owns its socket map
and drives waitress's event loop in half-second slices, and a stop ends the slice at once (it
pulls waitress's trigger: :class:`~flowforge.roles.stopping.Stop`). Then it stops accepting
and serves the requests under way to their end (at most DRAIN_S), closing each connection once
it waits for no answer: under ``flowforge up`` the next api child accepts on the same
inherited socket meanwhile (flowforge/api/listener.py), so SIGHUP's rolling restart refuses no
connection and cuts no answer.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from waitress import wasyncore

from flowforge.api.app import create_app
from flowforge.api.listener import parse_listen
from flowforge.api.wsgi_server import ClientRules, make_server
from flowforge.client import Client
from flowforge.config import Config, ReadAccess
from flowforge.errors import BootError, DatabaseUnavailableError
from flowforge.roles.presence import Presence
from flowforge.roles.stopping import on_stop
from flowforge.store.processes import Processes
from flowforge.telemetry import Telemetry

logger = logging.getLogger(__name__)
#: waitress warns "Task queue depth is N" for every request that waits for a thread: under a
#: burst that is a log line per request, written by the event-loop thread that serves every
#: connection (docs/performance.md, "Submitting work"). Its errors still pass.
logging.getLogger("waitress.queue").setLevel(logging.ERROR)

SLICE_S = 0.5
#: A stopping api serves the requests under way for at most this long (seconds), well inside
#: the supervisor's shutdown timeout for it (flowforge/up.py ROLE_SHUTDOWN_S).
DRAIN_S = 4.0
#: The event loop's slice while draining: short, as answers may be waiting to be flushed.
DRAIN_SLICE_S = 0.05
CHANNEL_TIMEOUT_S = 30  # a kept-alive connection idle this long is closed
#: File descriptors the process needs besides the api's connections (pools, logs, pipes).
SPARE_FDS = 64
WILDCARDS = frozenset({"0.0.0.0", "::"})


def check_fd_limit(connection_limit: int) -> None:
    """Refuse to boot when ``api.connection_limit`` cannot fit under ``RLIMIT_NOFILE``."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and connection_limit + SPARE_FDS > soft:
        raise BootError(
            f"api.connection_limit {connection_limit} does not fit the open-file limit"
            f" {soft} (ulimit -n) with {SPARE_FDS} to spare: lower it or raise the limit"
        )


def serve_out(
    server: Any, socket_map: dict[int, Any], beat: Callable[[], None], limit_s: float = DRAIN_S
) -> None:
    """Stop ``server`` accepting and drive ``socket_map`` until every connection has had its
    answer, for at most ``limit_s``. A connection idle between requests is closed (its client
    opens a new one, which another api child accepts from the shared queue); one whose request
    is arriving, being served or answered is served first. What is left at the limit is cut
    when the server closes (:meth:`ApiServer.shutdown`)."""
    server.accepting = False  # new connections wait in the accept queue for another child
    deadline = time.monotonic() + limit_s
    while server.active_channels and time.monotonic() < deadline:
        for channel in list(server.active_channels.values()):
            waits = channel.waiting()
            if waits is not None and waits[0] == 0:  # idle between two requests
                channel.will_close = True
        wasyncore.loop(timeout=DRAIN_SLICE_S, map=socket_map, use_poll=True, count=1)
        beat()
    if server.active_channels:
        logger.warning(
            "api stopping with %d connection(s) still busy after %.0fs",
            len(server.active_channels),
            limit_s,
            extra={"action": "api_drain_timeout"},
        )


class ApiServer:
    """The api role. ``tree`` reports this tree's child readiness (from the supervisor).
    ``listener``: the socket to serve, bound by ``flowforge up`` and shared with the other api
    children of the tree (flowforge/api/listener.py); None: bind ``api.listen`` here."""

    title = "Api"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        tree: Callable[[], dict[str, tuple[int, int]]] | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        if config.api is None:
            raise BootError("the config has no api section")
        self._config = config
        self._api = config.api
        self._tree = tree
        self._listener = listener
        self._client = Client(config)
        self._presence = Presence(Processes(self._client.database), "api")
        self._map: dict[int, Any] = {}
        self._server: Any = None

    def initialize(self) -> None:
        self._client.workflows  # noqa: B018 - a broken workflow file fails the boot here
        self._client.open()
        if self._server is None:
            self._server = self._listen()
        self._register()

    def _listen(self) -> Any:
        api = self._api
        host, port = parse_listen(api.listen)
        token = api.token  # read by load_config, from $token_env or a token file
        if token is None:
            reads = (
                " and every read of /api and /metrics"
                if api.read_access is ReadAccess.TOKEN
                else ""
            )
            logger.warning(
                "no api token ($%s, $%s_FILE or api.token_file): every mutating request%s"
                " will be refused",
                api.token_env,
                api.token_env,
                reads,
                extra={"action": "api_no_token"},
            )
        if api.allowed_hosts is None and host in WILDCARDS:
            logger.warning(
                "api.listen %s listens on every address but only localhost names are allowed"
                " in the Host header: set api.allowed_hosts to the names clients use",
                api.listen,
                extra={"action": "api_hosts_default"},
            )
        check_fd_limit(api.connection_limit)
        app = create_app(self._client, token, api, self._tree)
        where: dict[str, Any] = (
            {"host": host, "port": port} if self._listener is None else {"sock": self._listener}
        )
        try:
            server = make_server(
                app,
                self._map,
                api.max_body_bytes,
                ClientRules(
                    api.request_head_timeout_s,
                    api.request_body_timeout_s,
                    api.max_connections_per_client,
                ),
                threads=api.threads,
                connection_limit=api.connection_limit,
                ident="flowforge",
                channel_timeout=CHANNEL_TIMEOUT_S,
                **where,
            )
        except OSError as exc:
            raise BootError(f"api cannot listen on {api.listen}: {exc.strerror}") from exc
        logger.info(
            "api listening on http://%s:%s%s",
            host,
            server.effective_port,
            "" if self._listener is None else " (the tree's socket)",
            extra={"action": "api_listening"},
        )
        return server

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        # a stop pulls waitress's trigger (a pipe in the map): the slice ends at once
        forget = on_stop(stop, self._wake)
        try:
            while not stop.is_set():
                # poll(2), not select(2): no FD_SETSIZE ceiling on the connection limit
                wasyncore.loop(timeout=SLICE_S, map=self._map, use_poll=True, count=1)
                beat()
                self._register(tick=True)
        finally:
            forget()
        if self._server is not None:
            serve_out(self._server, self._map, beat)

    def _wake(self) -> None:
        """End the event loop's slice (from the thread that sets the stop)."""
        if self._server is not None:
            self._server.pull_trigger()

    def _register(self, tick: bool = False) -> None:
        """Keep serving while PostgreSQL is down: readiness must be able to say so."""
        try:
            self._presence.tick() if tick else self._presence.announce()
        except DatabaseUnavailableError as exc:
            logger.debug("cannot refresh the api's registration: %s", exc)

    def reset(self) -> None:
        self._client.close()

    def shutdown(self) -> None:
        self._presence.leave()
        if self._server is not None:
            self._server.close()
            self._server.task_dispatcher.shutdown(cancel_pending=False, timeout=5)
        self._client.close()
