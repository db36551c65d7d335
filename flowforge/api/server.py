"""The api child: serves the falcon app with waitress until told to stop.

Like the other roles it has ``initialize / loop / reset / shutdown``; it owns its socket map
and drives waitress's event loop in short slices, so a stop request is seen within half a
second and in-flight requests get to finish.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from waitress import wasyncore

from flowforge.api.app import create_app
from flowforge.api.wsgi_server import make_server
from flowforge.client import Client
from flowforge.config import Config
from flowforge.errors import BootError, DatabaseUnavailableError
from flowforge.roles.presence import Presence
from flowforge.telemetry import Telemetry

logger = logging.getLogger(__name__)

THREADS = 4
SLICE_S = 0.5
CHANNEL_TIMEOUT_S = 30


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise BootError(f"api.listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class ApiServer:
    """The api role. ``tree`` reports this tree's child readiness (from the supervisor)."""

    title = "Api"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        tree: Callable[[], dict[str, tuple[int, int]]] | None = None,
    ) -> None:
        if config.api is None:
            raise BootError("the config has no api section")
        self._config = config
        self._api = config.api
        self._tree = tree
        self._client = Client(config)
        self._presence = Presence(self._client.repository, "api")
        self._map: dict[int, Any] = {}
        self._server: Any = None

    def initialize(self) -> None:
        self._client.workflows  # noqa: B018 - a broken workflow file fails the boot here
        self._client.open()
        if self._server is None:
            self._server = self._listen()
        self._register()

    def _listen(self) -> Any:
        host, port = parse_listen(self._api.listen)
        token = os.environ.get(self._api.token_env) or None
        if token is None:
            logger.warning(
                "$%s is not set: every mutating request will be refused",
                self._api.token_env,
                extra={"action": "api_no_token"},
            )
        app = create_app(self._client, token, self._api.max_body_bytes, self._tree)
        try:
            server = make_server(
                app,
                self._map,
                self._api.max_body_bytes,
                host=host,
                port=port,
                threads=THREADS,
                ident="flowforge",
                channel_timeout=CHANNEL_TIMEOUT_S,
            )
        except OSError as exc:
            raise BootError(f"api cannot listen on {self._api.listen}: {exc.strerror}") from exc
        logger.info("api listening on http://%s:%d", host, port, extra={"action": "api_listening"})
        return server

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        while not stop.is_set():
            wasyncore.loop(timeout=SLICE_S, map=self._map, count=1)
            beat()
            self._register(tick=True)

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
