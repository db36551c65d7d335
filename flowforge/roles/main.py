"""Running one role in the current process until it is told to stop.

Exit codes (``supervisor.exitcodes``): 0 after a clean stop, ``CHILD_RECYCLE`` when the worker
asks to be replaced, ``CHILD_BOOT_FAILURE`` when the role cannot start for a reason a restart
will not fix (bad config, handler import error, queue of the wrong type).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flowforge.config import Config
from flowforge.errors import BootError, ConfigError, DefinitionError, QueueTypeMismatchError
from flowforge.roles.output import drain
from flowforge.roles.runner import Role, run_role
from flowforge.roles.signals import stop_on_signals
from flowforge.telemetry import Telemetry
from supervisor import exitcodes

logger = logging.getLogger(__name__)

Tree = Callable[[], dict[str, tuple[int, int]]]


# Each child imports only its own role's modules (the api's web stack stays out of workers).
def _scheduler(config: Config, telemetry: Telemetry, _tree: Tree | None) -> Role:
    from flowforge.roles.scheduler import Scheduler

    return Scheduler(config, telemetry)


def _publisher(config: Config, telemetry: Telemetry, _tree: Tree | None) -> Role:
    from flowforge.roles.publisher import Publisher

    return Publisher(config, telemetry)


def _worker(config: Config, telemetry: Telemetry, _tree: Tree | None) -> Role:
    from flowforge.roles.output import capture
    from flowforge.roles.worker import Worker

    capture()  # before handlers are imported: their output becomes tagged records

    return Worker(config, telemetry)


def _api(config: Config, telemetry: Telemetry, tree: Tree | None) -> Role:
    from flowforge.api.server import ApiServer

    return ApiServer(config, telemetry, tree)


ROLES: dict[str, Callable[[Config, Telemetry, Tree | None], Role]] = {
    "scheduler": _scheduler,
    "publisher": _publisher,
    "worker": _worker,
    "api": _api,
}
BOOT_ERRORS = (ConfigError, DefinitionError, QueueTypeMismatchError, BootError)


def run(
    name: str,
    config: Config,
    beat: Callable[[], None] = lambda: None,
    ready: Callable[[], None] = lambda: None,
    tree: Tree | None = None,
) -> int:
    """Run the role called ``name`` until SIGTERM/SIGINT; return the exit code.

    ``beat`` and ``ready`` are a supervisor's liveness and readiness hooks; ``tree`` reports
    the readiness of the whole tree (the api shows it).
    """
    stop = threading.Event()
    with stop_on_signals(stop):  # first: a SIGTERM during the boot is a clean stop too
        telemetry = Telemetry.from_environment()
        telemetry.child_starts.labels(role=name).inc()
        try:
            role = ROLES[name](config, telemetry, tree)
            logger.info("%s starting", role.title, extra={"action": "role_start"})
            run_role(
                role,
                stop,
                beat=beat,
                ready=ready,
                on_reconnect=telemetry.reconnects.labels(role=name).inc,
            )
        except BOOT_ERRORS as exc:
            logger.error("%s cannot start: %s", name, exc, extra={"action": "boot_failed"})
            return exitcodes.CHILD_BOOT_FAILURE
    drain()  # a handler's last output is logged before the process exits
    if getattr(role, "recycle", False):
        return exitcodes.CHILD_RECYCLE
    logger.info("%s stopped", role.title, extra={"action": "role_stop"})
    return exitcodes.CLEAN
