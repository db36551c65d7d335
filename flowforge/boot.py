"""Which object each child of the tree runs: the role names and their entries.

``flowforge up`` forks a child per spec and calls :func:`run` in it; ``flowforge role NAME`` calls
it in the foreground. This is the one place that knows every kind of child, the api among them:
``flowforge/roles/`` runs a role it is handed and never imports an interface (tests/unit/
test_boot.py). Nothing is imported here at module level beyond the runner: each child imports
only its own role's modules, so the api's web stack stays out of the workers.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from flowforge.config import Config
from flowforge.roles import main
from flowforge.roles.runner import Role
from flowforge.telemetry import Telemetry

#: The readiness of the whole tree, by child name (from the supervisor; the api shows it).
Tree = Callable[[], dict[str, tuple[int, int]]]


@dataclass(frozen=True)
class Given:
    """What a tree hands a child beside the config: ``tree``, its readiness (the api shows it),
    and ``listener``, the api's listening socket, bound once by ``flowforge up`` and shared by
    its api children (flowforge/api/listener.py). Both None under ``flowforge role NAME``."""

    tree: Tree | None = None
    listener: socket.socket | None = None


#: Builds a child's role from the config, its telemetry and what the tree gave it.
Entry = Callable[[Config, Telemetry, Given], Role]


def _scheduler(config: Config, telemetry: Telemetry, _given: Given) -> Role:
    from flowforge.roles.scheduler import Scheduler

    return Scheduler(config, telemetry)


def _publisher(config: Config, telemetry: Telemetry, _given: Given) -> Role:
    from flowforge.roles.publisher import Publisher

    return Publisher(config, telemetry)


def _worker(config: Config, telemetry: Telemetry, _given: Given) -> Role:
    from flowforge.roles.output import capture
    from flowforge.roles.worker import Worker

    capture()  # before handlers are imported: their output becomes tagged records

    return Worker(config, telemetry)


def _api(config: Config, telemetry: Telemetry, given: Given) -> Role:
    from flowforge.api.server import ApiServer

    return ApiServer(config, telemetry, given.tree, given.listener)


#: The children a tree can have, by the name ``flowforge role NAME`` and the specs use.
ROLES: dict[str, Entry] = {
    "scheduler": _scheduler,
    "publisher": _publisher,
    "worker": _worker,
    "api": _api,
}


def run(
    name: str,
    config: Config,
    beat: Callable[[], None] = lambda: None,
    ready: Callable[[], None] = lambda: None,
    given: Given = Given(),
) -> int:
    """Run the child called ``name`` until SIGTERM/SIGINT; return its exit code
    (``flowforge.roles.main.run``). ``given``: what the tree hands it (:class:`Given`)."""
    entry = ROLES[name]
    return main.run(name, lambda c, t: entry(c, t, given), config, beat=beat, ready=ready)
