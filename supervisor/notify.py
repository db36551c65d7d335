"""The sd_notify protocol: telling the service manager (systemd) how this process is doing.

The protocol (sd_notify(3), systemd.service(5) ``Type=notify``): one datagram of newline-separated
``KEY=value`` fields (``READY=1``, ``STATUS=…``, ``WATCHDOG=1``, ``STOPPING=1``, ``RELOADING=1``,
``MONOTONIC_USEC=…``) sent over an ``AF_UNIX`` ``SOCK_DGRAM`` socket to the address in
``$NOTIFY_SOCKET``: a filesystem path, or — with a leading ``@`` — a name in Linux's abstract
namespace. ``$WATCHDOG_USEC`` asks for ``WATCHDOG=1`` at least that often (microseconds; half of it
is the recommended cadence), but only from the process ``$WATCHDOG_PID`` names when that is set
(sd_watchdog_enabled(3)). With no ``$NOTIFY_SOCKET`` every call is a no-op.

Standard library rather than a package: ``systemd-python`` binds libsystemd and builds from C
against its headers; ``sdnotify`` (last released 2017) keeps one socket open from construction
(a descriptor every forked child would inherit), either swallows every error silently or raises
it, and reads neither ``WATCHDOG_USEC`` nor ``WATCHDOG_PID``. What is needed here — both address
shapes, a bounded send that never raises, the first failure logged once, the variables taken out
of the environment so children cannot inherit them — takes a few dozen lines of the standard
library, which one of them would not save.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping, Sequence

logger = logging.getLogger(__name__)

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"
#: The variables taken out of the environment (as sd_notify's ``unset_environment`` does).
VARIABLES = (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID)
#: Longest wait for room in the manager's queue (seconds): a send never wedges the caller.
SEND_TIMEOUT_S = 0.5


class Notifier:
    """Sends ``KEY=value`` fields to ``address`` (a path, or ``@name`` for the abstract
    namespace; None: nowhere). ``watchdog_usec``: the manager's watchdog timeout for this
    process in microseconds (None: no watchdog)."""

    def __init__(self, address: str | None = None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._failed = False

    @classmethod
    def from_environment(
        cls, environ: MutableMapping[str, str] | None = None, pid: int | None = None
    ) -> Notifier:
        """The notifier the environment asks for, taking its variables out of ``environ``
        (default ``os.environ``) so that no process started after this inherits them: only the
        main process talks to the manager (``NotifyAccess=main``). ``pid``: this process's."""
        env = os.environ if environ is None else environ
        found = {name: env.pop(name, "") for name in VARIABLES}
        address = found[NOTIFY_SOCKET] or None
        if address is not None and not address.startswith(("/", "@")):
            logger.warning(
                "%s=%r is neither a path nor an @abstract name; not notifying the service manager",
                NOTIFY_SOCKET,
                address,
            )
            address = None
        usec, watched = found[WATCHDOG_USEC], found[WATCHDOG_PID]
        mine = str(os.getpid() if pid is None else pid)
        # sd_watchdog_enabled(3): a positive timeout, for this process (or any, without a pid)
        for_us = usec.isascii() and usec.isdigit() and int(usec) > 0 and watched in ("", mine)
        notifier = cls(address, int(usec) if for_us else None)
        if address is not None:
            interval = notifier.watchdog_interval_s()
            logger.info(
                "notifying the service manager at %s%s",
                address,
                f"; watchdog every {interval:.1f}s" if interval else "",
                extra={"action": "notify_socket"},
            )
        return notifier

    @property
    def enabled(self) -> bool:
        """Whether a service manager listens."""
        return self.address is not None

    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1`` (seconds): half the manager's timeout, as
        sd_watchdog_enabled(3) recommends; None when there is no watchdog or no manager."""
        if self.address is None or self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2_000_000

    def send(self, fields: Sequence[str]) -> bool:
        """Send ``fields`` (``KEY=value`` each, no newline inside) as one message; whether it
        was sent. Never raises: the first failure is logged as a warning, later ones at debug."""
        if self.address is None or not fields:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        data = ("\n".join(fields) + "\n").encode("utf-8", "replace")
        try:
            # A socket per message, closed at once: no descriptor for a forked child to inherit.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(data, target)
        except (OSError, ValueError) as exc:
            level = logging.DEBUG if self._failed else logging.WARNING
            self._failed = True
            logger.log(
                level,
                "cannot notify the service manager at %s: %s%s",
                self.address,
                exc,
                "" if level == logging.DEBUG else " (further failures are logged at debug level)",
                extra={"action": "notify_failed"},
            )
            return False
        return True
