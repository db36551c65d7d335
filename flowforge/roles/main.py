"""Running one role in the current process until it is told to stop.

Which role a name means is the boot code's business (flowforge/boot.py); this module runs the
one it is handed.

Exit codes (``supervisor.exitcodes``): 0 after a clean stop, ``CHILD_RECYCLE`` when the worker
asks to be replaced, ``CHILD_BOOT_FAILURE`` when the role cannot start for a reason a restart
will not fix (bad config, handler import error, queue of the wrong type).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flowforge.config import Config
from flowforge.errors import BootError, ConfigError, DefinitionError, QueueTypeMismatchError
from flowforge.roles.output import drain
from flowforge.roles.runner import Role, run_role
from flowforge.roles.signals import stop_on_signals
from flowforge.roles.stopping import Stop
from flowforge.telemetry import Telemetry
from supervisor import exitcodes

logger = logging.getLogger(__name__)

#: Builds the role from the config and the process's telemetry (flowforge/boot.py: by name).
Build = Callable[[Config, Telemetry], Role]
BOOT_ERRORS = (ConfigError, DefinitionError, QueueTypeMismatchError, BootError)


def run(
    name: str,
    build: Build,
    config: Config,
    beat: Callable[[], None] = lambda: None,
    ready: Callable[[], None] = lambda: None,
) -> int:
    """Run the role ``build`` makes, called ``name``, until SIGTERM/SIGINT; return the exit code.

    ``beat`` and ``ready`` are a supervisor's liveness and readiness hooks.
    """
    stop = Stop()  # its set() wakes the role's waits (roles/stopping.py)
    with stop_on_signals(stop):  # first: a SIGTERM during the boot is a clean stop too
        telemetry = Telemetry.from_environment()
        telemetry.child_starts.labels(role=name).inc()
        try:
            role = build(config, telemetry)
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
