"""Keeping a role alive through PostgreSQL and RabbitMQ outages, without a process restart.

A role (what runs) is separate from how it is spawned: it has ``initialize`` (open connections,
register), ``loop`` (work until the stop event is set), ``reset`` (drop connections after a
failure) and ``shutdown`` (close cleanly). :func:`run_role` calls them, backs off exponentially
with jitter (capped at 30 s) on connection-level failures, waiting on the stop event so a stop
request during an outage returns promptly, and logs ``<Role> recovered`` when it reconnects.
Anything else — a bad config, a queue of the wrong type — propagates: retrying cannot fix it.

Who retries a failed statement — one level for each failure, never two:

* :class:`~flowforge.store.db.Database` runs a transaction again, whole and at once, when
  PostgreSQL rolled it back for a conflict (a deadlock, a serialization failure): nothing of it
  took effect, and only the store holds the whole transaction. Up to ``TRANSACTION_ATTEMPTS``
  runs, for every caller. It retries no outage: it raises
  :class:`~flowforge.errors.DatabaseUnavailableError` once, from the statement that met it.
* The worker's :class:`~flowforge.roles.ledger.Ledger` retries its *finish* through an outage,
  with this module's backoff, serving the broker meanwhile, until it commits or the leases have
  lapsed: the one statement whose loss would run handlers again. Its claims and hand-backs are
  not retried there (a failed claim propagates; a failed hand-back is left to the leases).
* :func:`run_role` handles every other outage of a role
  (:data:`~flowforge.errors.TRANSIENT_ERRORS`): it does not repeat the statement but drops
  every connection (``reset``), backs off, and starts the role's loop again.
* Nothing retries anything else. A conflict still there after the ``Database``'s runs is
  contention that running again did not cure: it propagates like any other error (a role
  process exits and its supervisor restarts it; the API answers 500, the CLI exits 1). The API
  and the CLI retry no outage: 503 / exit 7, the caller decides.

``tests/unit/test_retry_levels.py`` counts the attempts of each level.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.errors import (
    TRANSIENT_ERRORS,
    BrokerConfigError,
    DatabaseConfigError,
    FlowForgeError,
)

logger = logging.getLogger(__name__)

#: A server that refuses the configuration (a database, or TLS to a broker): fatal at boot,
#: survived once the role has run; what the log says of it, and its action.
_REFUSALS: dict[type[FlowForgeError], tuple[str, str]] = {
    DatabaseConfigError: ("cannot use the database", "database_refused"),
    BrokerConfigError: ("cannot use the broker", "broker_refused"),
}
#: What a role survives by backing off; a refusal only once it has started.
_SURVIVABLE: tuple[type[FlowForgeError], ...] = (*TRANSIENT_ERRORS, *_REFUSALS)

#: Reconnection backoff: 0.5 s doubling to 30 s, equal jitter (never a zero wait).
#: Longest stretch without calling ``beat`` while backing off (seconds).
BEAT_INTERVAL_S = 1.0
RECONNECT_BACKOFF = RetryPolicy(max_attempts=1, base_delay=0.5, max_delay=30.0, jitter=Jitter.EQUAL)


class Role(Protocol):
    """What a role process runs. ``title`` is used in logs ("Scheduler recovered")."""

    title: str

    def initialize(self) -> None: ...

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...


def _nothing() -> None:
    """The default hook."""


def run_role(
    role: Role,
    stop: threading.Event,
    backoff: RetryPolicy = RECONNECT_BACKOFF,
    rand: Callable[[], float] = random.random,
    beat: Callable[[], None] = _nothing,
    ready: Callable[[], None] = _nothing,
    on_reconnect: Callable[[], None] = _nothing,
) -> None:
    """Run ``role`` until ``stop`` is set (or its loop returns), surviving transient outages.

    ``beat`` is called at least every :data:`BEAT_INTERVAL_S` while the role is healthy or
    backing off (a supervisor's liveness check); ``ready`` after each successful initialize.

    A :class:`DatabaseConfigError` (no such database, authentication failed, not migrated, a
    TLS failure) or :class:`BrokerConfigError` (a TLS failure) before the first successful
    initialize propagates: the role fails to boot, so a wrong URL or certificate stops
    ``flowforge up`` at once. Once the role has run, the same configuration worked, so the
    server changed (a restore, a password or certificate rotation): it is logged as an error on
    every attempt and retried like an outage, and the role resumes when the server is fixed.
    """
    failures = 0
    started = False
    try:
        while not stop.is_set():
            try:
                role.initialize()
                started = True
                ready()
                if failures:
                    logger.info("%s recovered", role.title, extra={"action": "recovered"})
                    failures = 0
                role.loop(stop, beat)
                return
            except _SURVIVABLE as exc:
                refused = next((r for k, r in _REFUSALS.items() if isinstance(exc, k)), None)
                if refused and not started:
                    raise
                said, action = refused or ("lost a connection", "reconnecting")
                failures += 1
                delay = backoff.delay(failures, rand)
                logger.log(
                    logging.ERROR if refused else logging.WARNING,
                    "%s %s (%s); reconnecting in %.1fs",
                    role.title,
                    said,
                    exc,
                    delay,
                    extra={"action": action},
                )
                role.reset()
                on_reconnect()
                _wait(stop, delay, beat)
    finally:
        role.shutdown()


def _wait(stop: threading.Event, seconds: float, beat: Callable[[], None]) -> None:
    """Wait on ``stop`` for ``seconds``, beating in between: a long backoff is not a hang."""
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        beat()
        stop.wait(min(remaining, BEAT_INTERVAL_S))
