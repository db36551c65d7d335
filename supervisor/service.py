"""What the tree tells its service manager, and when (systemd ``Type=notify``; supervisor/notify.py
speaks the protocol).

The loop reports what happens; this turns it into messages, sent through the OS seam
(``OsApi.notify``), so the order and timing are tested over the fake OS:

- ``STATUS=starting: …`` while the children boot (each time a count changes), then ``READY=1``
  once every spec has its desired number of ready children — never before.
- ``STATUS=ready: …`` / ``STATUS=degraded: …`` while running: the counts, and the last child
  that exited and when it comes back.
- ``RELOADING=1`` with ``MONOTONIC_USEC`` on SIGHUP's rolling restart, then ``READY=1`` once every
  rolling child has been replaced (``MONOTONIC_USEC`` lets ``Type=notify-reload`` match the
  reload to its signal; plain ``Type=notify`` ignores it).
- ``STOPPING=1`` when a drain starts; ``STATUS=draining …`` as children stop.
- ``WATCHDOG=1`` from the loop itself, every half of ``WATCHDOG_USEC``: a wedged loop stops
  sending it and the manager restarts the service.
"""

from __future__ import annotations

from enum import Enum

from supervisor.osapi import OsApi


class Phase(Enum):
    STARTING = "starting"
    READY = "ready"
    RELOADING = "reloading"
    STOPPING = "stopping"


class ServiceNotifications:
    """The messages for one tree's life, sent through ``system`` (see the module docstring)."""

    def __init__(self, system: OsApi) -> None:
        self._system = system
        self.phase = Phase.STARTING
        self._status = ""
        self._event = ""  # the last child exit since the tree was last whole
        self._rolling = 0  # rolling children left to replace when the reload began
        self._stop_reason = ""
        self._next_pet: float | None = None

    def tick(self, now: float) -> None:
        """The loop finished a turn: pet the watchdog if it is due."""
        interval = self._system.watchdog_interval_s()
        if interval is not None and (self._next_pet is None or now >= self._next_pet):
            self._system.notify(["WATCHDOG=1"])
            self._next_pet = now + interval

    def running(self, summary: str, whole: bool, rolling: int) -> None:
        """A turn while running: ``summary`` of the ready counts, ``whole`` when every spec has
        its desired number ready, ``rolling`` children still to replace in a rolling restart."""
        if self.phase is Phase.STARTING:
            if whole:
                self.phase = Phase.READY
                self._send(f"ready: {summary}", "READY=1")
            else:
                self._send(f"starting: {summary}")
            return
        if self.phase is Phase.RELOADING and not rolling:
            self.phase = Phase.READY
            self._event = ""
            self._send(self._running_status(summary, whole), "READY=1")
            return
        if self.phase is Phase.RELOADING:
            self._send(f"reloading: rolling restart, {rolling} of {self._rolling} left; {summary}")
            return
        if whole:
            self._event = ""
        self._send(self._running_status(summary, whole))

    def child_exited(self, what: str) -> None:
        """A child exited and will be started again: ``what`` says which, how and when."""
        self._event = what

    def reloading(self, rolling: int) -> None:
        """SIGHUP began a rolling restart of ``rolling`` children."""
        if self.phase is not Phase.READY and self.phase is not Phase.RELOADING:
            return  # still starting: READY=1 comes once the tree is whole
        self.phase = Phase.RELOADING
        self._rolling = rolling
        now_usec = int(self._system.monotonic() * 1_000_000)
        self._send(
            f"reloading: rolling restart of {rolling} child(ren)",
            "RELOADING=1",
            f"MONOTONIC_USEC={now_usec}",
        )

    def draining(self, why: str, timeout_s: float, children: int) -> None:
        """A graceful drain began (``why``): nothing is restarted any more."""
        self.phase = Phase.STOPPING
        self._stop_reason = f"draining ({why}) within {timeout_s:.0f}s"
        self._send(f"{self._stop_reason}: {children} child(ren) left", "STOPPING=1")

    def fast_stop(self, why: str, children: int) -> None:
        """Every child is being killed (``why``)."""
        first = self.phase is not Phase.STOPPING
        self.phase = Phase.STOPPING
        self._stop_reason = f"fast stop ({why})"
        fields = ("STOPPING=1",) if first else ()
        self._send(f"{self._stop_reason}: {children} child(ren) left", *fields)

    def stopping(self, children: int) -> None:
        """A turn while stopping: ``children`` are still running."""
        self._send(f"{self._stop_reason}: {children} child(ren) left")

    def _running_status(self, summary: str, whole: bool) -> str:
        if whole:
            return f"ready: {summary}"
        return f"degraded: {summary}" + (f"; {self._event}" if self._event else "")

    def _send(self, status: str, *fields: str) -> None:
        """``fields`` always; the status only when it changed (or goes with them)."""
        status = " ".join(status.split())  # one line, whatever a child's name holds
        if status == self._status and not fields:
            return
        self._status = status
        self._system.notify([*fields, f"STATUS={status}"])
