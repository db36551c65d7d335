"""``flowforge up`` under a stand-in for systemd: what it sends to ``$NOTIFY_SOCKET``, and when.

There is no systemd to run the unit here, so the test does what systemd does for a
``Type=notify`` service with ``WatchdogSec=``: it binds an ``AF_UNIX`` datagram socket, starts a
real tree with ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` in its environment and reads every
message on a thread that does nothing else, noting the monotonic time of each. It checks
``READY=1`` against the tree's own log and ``flowforge ps``, the watchdog's cadence,
``RELOADING=1`` … ``READY=1`` around a SIGHUP, ``STOPPING=1`` after SIGTERM and a clean exit, and
that no child — nor a handler in one — sees the variables.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowforge.domain.states import RunState
from supervisor.tree import TICK_S
from tests.e2e import REPO, Stack
from tests.helpers import single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real flowforge up tree

WATCHDOG_USEC = 2_000_000  # WatchdogSec=2: a WATCHDOG=1 every second
READY_S = 60.0
STOP_S = 40.0
VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True)
class Message:
    at: float  # when the reader got it (time.monotonic())
    fields: tuple[str, ...]

    def value(self, key: str) -> str | None:
        found = [f.split("=", 1)[1] for f in self.fields if f.startswith(f"{key}=")]
        return found[-1] if found else None


class NotifySocket:
    """A bound ``AF_UNIX`` datagram socket read on a thread, as systemd's notify socket is."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            at = time.monotonic()
            fields = tuple(data.decode().rstrip("\n").split("\n"))
            with self._lock:
                self.messages.append(Message(at, fields))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close()

    def seen(self) -> list[Message]:
        with self._lock:
            return list(self.messages)

    def with_field(self, field: str) -> list[Message]:
        return [m for m in self.seen() if field in m.fields]

    def wait(self, what: str, found: Callable[[list[Message]], bool], timeout: float) -> None:
        wait_for(lambda: found(self.seen()), timeout=timeout, interval=0.05, what=what)


@contextlib.contextmanager
def tree_under_notify(stack: Stack) -> Iterator[tuple[subprocess.Popen[bytes], Path, NotifySocket]]:
    """``flowforge up`` (one worker) with a stand-in notify socket; stopped after the test."""
    config = stack.config_path(processes={"workers": 1})
    notify = NotifySocket(stack.directory / "notify.sock")
    env = {**stack.env(), "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    log_path = stack.directory / "up.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, config, notify
    finally:
        if proc.poll() is None:
            proc.kill()  # the test failed midway: its supervisor's children die with it
            proc.wait(STOP_S)
        notify.close()


def children_of(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: pid → process title."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = title
    return found


def flowforge_ps(config: Path, env: dict[str, str]) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), "ps", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def test_up_tells_a_notify_socket_ready_watchdog_reload_and_stopping(
    stack: Stack, repo: Store
) -> None:
    with tree_under_notify(stack) as (proc, config, notify):
        log_path = stack.directory / "up.log"
        notify.wait("READY=1", lambda seen: any("READY=1" in m.fields for m in seen), READY_S)
        log = log_path.read_text(errors="replace")
        assert proc.poll() is None, log[-3000:]

        # READY=1 after the tree logged that every role reported ready, and not before
        assert "tree ready: scheduler 1/1, worker 1/1, publisher 1/1" in log
        seen = notify.seen()
        first_ready = next(i for i, m in enumerate(seen) if "READY=1" in m.fields)
        assert (
            seen[first_ready].value("STATUS") == "ready: scheduler 1/1, worker 1/1, publisher 1/1"
        )
        # (none at all when every child was ready by the end of the supervisor's first turn)
        before = [m.value("STATUS") for m in seen[:first_ready] if m.value("STATUS")]
        assert all(s is not None and s.startswith("starting: ") for s in before), before
        # … by which time every child of the tree had registered (flowforge ps)
        children = children_of(proc.pid)
        assert len(children) == 3, children
        registered = {row["pid"]: row["role"] for row in flowforge_ps(config, stack.env())}
        assert {registered.get(pid) for pid in children} == {"scheduler", "worker", "publisher"}

        # no child inherited the variables. /proc/PID/environ shows the block a process was
        # exec'd with (setproctitle reuses it for the title); what a handler reads is the proof.
        for pid in children:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert not [v for v in VARIABLES if f"{v}=".encode() in environ], pid
        run_id = repo.trigger(single("env", "e2e.environ"), {"names": list(VARIABLES)}).run_id
        wait_for(
            lambda: repo.get_run(run_id).state is RunState.SUCCEEDED,
            timeout=60,
            what="the environment to be read by a handler",
        )
        assert repo.get_run(run_id).tasks[0].result == dict.fromkeys(VARIABLES)

        # the watchdog: every half of WATCHDOG_USEC (on average: a late read shortens the next
        # gap), and never a gap as long as WATCHDOG_USEC, when systemd would act
        notify.wait(
            "5 watchdog pets",
            lambda s: len([m for m in s if m.fields == ("WATCHDOG=1",)]) >= 5,
            30.0,
        )
        pets = [m.at for m in notify.with_field("WATCHDOG=1")]
        gaps = [b - a for a, b in itertools.pairwise(pets)]
        half = WATCHDOG_USEC / 2_000_000
        assert max(gaps) < 2 * half, gaps
        assert half <= (pets[-1] - pets[0]) / len(gaps) <= half + TICK_S, gaps

        # SIGHUP: RELOADING=1 stamped with the monotonic clock, then READY=1 when replaced
        hup_usec = time.monotonic_ns() // 1000
        proc.send_signal(signal.SIGHUP)
        notify.wait(
            "READY=1 after RELOADING=1",
            lambda s: (
                [f for m in s for f in m.fields if f in ("RELOADING=1", "READY=1")][-2:]
                == ["RELOADING=1", "READY=1"]
            ),
            READY_S,
        )
        (reloading,) = notify.with_field("RELOADING=1")
        assert (
            hup_usec <= int(reloading.value("MONOTONIC_USEC") or 0) <= time.monotonic_ns() // 1000
        )
        # the worker, then the scheduler (the publisher holds no code or definitions)
        assert "rolling restart of 2 child(ren)" in log_path.read_text(errors="replace")
        assert len(notify.with_field("READY=1")) == 2

        # SIGTERM: STOPPING=1, and the tree drains and exits 0
        term_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(STOP_S)
        log = log_path.read_text(errors="replace")
        assert code == 0, log[-3000:]
        (stopping,) = notify.with_field("STOPPING=1")
        assert stopping.at > term_at
        assert (stopping.value("STATUS") or "").startswith("draining (received SIGTERM) within 25s")
        assert not [m for m in notify.seen() if m.at > stopping.at and "READY=1" in m.fields]
        assert not children_of(proc.pid)
