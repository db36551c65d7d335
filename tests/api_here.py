"""The api role served from this process: :class:`~flowforge.api.server.ApiServer` on a thread.

Starting ``flowforge role api`` costs an interpreter and its imports per test. Tests of what
the server does with requests and connections — tokens, hosts, body limits, deadlines, caps —
get the same server object (the falcon app under FlowForge's waitress server, listening on a
real socket) from :class:`ApiHere` in milliseconds. What needs the process — its log stream,
``flowforge up`` — is tested on a real api child (tests/api_client.py ``start_api``), and so is
one module-wide api per module that reads the api.
"""

from __future__ import annotations

import threading

from flowforge.api.server import ApiServer, parse_listen
from flowforge.config import Config
from flowforge.roles.stopping import Stop

#: A bound on the server's stop (the stop ends its loop slice at once), not a wait.
STOP_TIMEOUT_S = 15.0


class ApiHere:
    """One api role on a thread of this process: :meth:`start`, then :meth:`stop`.

    Its bearer token is the config's (``load_config`` reads it from the environment it is
    given, as the api child's config does from its own).
    """

    def __init__(self, config: Config) -> None:
        assert config.api is not None, "the config needs an api section"
        _host, self.port = parse_listen(config.api.listen)
        self._server = ApiServer(config)
        self._stop = Stop()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._server.initialize()  # listening once this returns
        self._thread = threading.Thread(
            target=self._server.loop, args=(self._stop, lambda: None), name="api-here", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # pulls the server's trigger: its poll ends now, not a slice later
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            assert not self._thread.is_alive(), "the api thread did not stop"
        self._server.shutdown()
        self._stop.close()
