"""``/health/live`` and ``/health/ready``.

Ready means: PostgreSQL answers, RabbitMQ accepts a connection and knows the task queue, and a
scheduler, a publisher and at least one worker of some tree are alive in the process registry.
Any failure is a 503 whose body names the component in error (``"rabbitmq": "error"``) and
nothing more: the probes are open to anyone who can reach the port, so no error text, URL or
host name is ever in a body. A queue with READY tasks and no live worker consuming it is a
warning, not a failure: ``"unserved_queues": [names]`` in a 200 (docs/flow-control.md) — the
queue may be another tree's, starting, or deliberately idle.

The checks' result is kept for ``api.ready_cache_s``: a storm of probes runs them (and opens a
broker connection) at most once per interval, never once per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import falcon
import pika
import pika.exceptions

from flowforge.broker.topology import connection_parameters
from flowforge.config import BrokerConfig
from flowforge.errors import FlowForgeError
from flowforge.store.reads import LIVE_S, Reads
from flowforge.views import dumps

#: A registered process seen within this many seconds counts as alive.
FRESH_S = LIVE_S
REQUIRED_ROLES = ("scheduler", "publisher", "worker")
#: Keys of the checks that report, never fail, the probe.
WARNINGS = ("unserved_queues",)
BROKER_CHECK_TIMEOUT_S = 2.0


class Live:
    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({"status": "ok"})


class Ready:
    """``/health/ready``: ``check`` (see :class:`Checks`) run at most once per ``cache_s``
    seconds of ``clock`` (0: on every request); ``tree`` adds this tree's own child readiness.

    Concurrent probes wait for the one check in flight and share its result.
    """

    def __init__(
        self,
        check: Callable[[], dict[str, Any]],
        tree: Callable[[], dict[str, tuple[int, int]]] | None = None,
        cache_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._tree = tree
        self._cache_s = cache_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: dict[str, Any] | None = None
        self._checked_at = 0.0

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        checks = self.checks()
        ok = all(v == "ok" for k, v in checks.items() if k != "tree" and k not in WARNINGS)
        resp.status = falcon.HTTP_200 if ok else falcon.HTTP_503
        resp.content_type = falcon.MEDIA_JSON
        body: dict[str, object] = {"status": "ok" if ok else "error", **checks}
        if self._tree is not None:
            body["tree"] = {name: f"{have}/{want}" for name, (have, want) in self._tree().items()}
        resp.text = dumps(body)

    def checks(self) -> dict[str, Any]:
        """The checks' result, run afresh only when the kept one is ``cache_s`` old."""
        with self._lock:
            if self._cached is None or self._clock() - self._checked_at >= self._cache_s:
                self._cached = self._check()
                self._checked_at = self._clock()
            return dict(self._cached)


class Checks:
    """PostgreSQL, RabbitMQ and the process registry, each ``"ok"`` or ``"error"``; and,
    only when there are some, the queues with READY tasks and no live consumer (a warning)."""

    def __init__(self, reads: Reads, broker: BrokerConfig) -> None:
        self._reads = reads
        self._broker = broker

    def __call__(self) -> dict[str, Any]:
        checks: dict[str, Any] = {"postgres": "ok", "rabbitmq": self._check_broker()}
        unserved: list[str | None] = []
        try:
            self._reads.ping()
            alive = self._reads.live_process_counts(FRESH_S)
            unserved = [q.queue for q in self._reads.queue_loads(FRESH_S) if q.unserved]
        except FlowForgeError:
            checks["postgres"] = "error"
            alive = {}
        for role in REQUIRED_ROLES:
            checks[role] = "ok" if alive.get(role, 0) > 0 else "error"
        if unserved:
            checks["unserved_queues"] = unserved
        return checks

    def _check_broker(self) -> str:
        try:
            params = connection_parameters(self._broker)
        except FlowForgeError:  # a broker.tls file that cannot be used
            return "error"
        for p in params:
            p.socket_timeout = BROKER_CHECK_TIMEOUT_S
            p.stack_timeout = BROKER_CHECK_TIMEOUT_S
            p.blocked_connection_timeout = BROKER_CHECK_TIMEOUT_S
        try:
            conn = pika.BlockingConnection(params)
        except (pika.exceptions.AMQPError, OSError):
            return "error"
        try:
            conn.channel().queue_declare(self._broker.queue, passive=True)
            return "ok"
        except (pika.exceptions.AMQPError, OSError):
            return "error"
        finally:
            if conn.is_open:
                conn.close()
