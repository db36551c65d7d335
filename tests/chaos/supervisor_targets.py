"""Small child targets for tests of the generic supervisor, and a command that runs a tree of them.

``python -m tests.chaos.supervisor_targets SCENARIO PREFIX`` runs one scenario's tree in this
process (the supervisor's ``waitpid(-1)``, signal handlers and child-subreaper flag belong in
a process of their own, never in pytest's). ``PREFIX`` starts every process title of the tree
(``PREFIX: supervisor``, ``PREFIX: chatty 2/3``), so a test finds its processes in ``/proc``.
Every line of the tree is JSON on stderr. Every target ends on its own within
:data:`MAX_LIFETIME_S`, so nothing can outlive a broken test for long.
"""

from __future__ import annotations

import logging
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Callable

from supervisor import logs
from supervisor.child import ChildContext
from supervisor.restart import IntensityLimit
from supervisor.spec import ChildSpec, Restart
from supervisor.titles import set_title
from supervisor.tree import Supervisor

#: No target lives longer than this (seconds).
MAX_LIFETIME_S = 120.0
#: The message of every line a chatty child logs.
CHATTER = "chatter"
#: Chatty payloads are between these sizes (bytes): a JSON line stays under PIPE_BUF (4096).
PAYLOAD_MIN, PAYLOAD_MAX = 64, 3400
#: The liveness timeout of the hanging children (seconds).
HANG_LIVENESS_S = 1.0
#: How long a hanging child beats before it falls silent (seconds).
BEATING_S = 0.5
#: How long an orphaned grandchild lives after its parent exited (seconds).
GRANDCHILD_S = 2.0
#: How long a slow starter takes to become ready (seconds).
SLOW_BOOT_S = 1.0

logger = logging.getLogger("supervisor_targets")


def payload(pid: int, seq: int, size: int) -> str:
    """The text a chatty child logs as line ``seq``: the test recomputes it to find tearing."""
    unit = f"{pid}:{seq};"
    return (unit * (size // len(unit) + 1))[:size]


def chatty(ctx: ChildContext) -> int:
    """Logs JSON lines of random length in a tight loop, numbered from 1 without gaps."""
    ctx.ready()
    pid = os.getpid()
    rng = random.Random(pid)
    deadline = time.monotonic() + MAX_LIFETIME_S
    seq = 0
    while time.monotonic() < deadline:
        seq += 1
        size = rng.randrange(PAYLOAD_MIN, PAYLOAD_MAX)
        logger.info(CHATTER, extra={"seq": seq, "size": size, "payload": payload(pid, seq, size)})
    return 0


def idle(ctx: ChildContext) -> int:
    """Beats and does nothing else."""
    ctx.ready()
    deadline = time.monotonic() + MAX_LIFETIME_S
    while time.monotonic() < deadline:
        ctx.beat()
        time.sleep(0.1)
    return 0


def _beat_then_hang(ctx: ChildContext) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT must not leave a core file
    ctx.ready()
    until = time.monotonic() + BEATING_S
    while time.monotonic() < until:
        ctx.beat()
        time.sleep(0.05)
    logger.info("falling silent", extra={"action": "silent"})
    time.sleep(MAX_LIFETIME_S)  # alive, but no more beats
    return 0


def hanger(ctx: ChildContext) -> int:
    """Beats for a moment, then stays alive without beating (dies of the default SIGABRT)."""
    return _beat_then_hang(ctx)


def stubborn(ctx: ChildContext) -> int:
    """Like :func:`hanger`, but ignores SIGABRT: only SIGKILL ends it."""
    signal.signal(signal.SIGABRT, signal.SIG_IGN)
    return _beat_then_hang(ctx)


def slow_starter(ctx: ChildContext) -> int:
    """Ready only after :data:`SLOW_BOOT_S`; logs when SIGTERM arrived (``signalled_at``)."""
    signalled: list[float] = []
    signal.signal(signal.SIGTERM, lambda _signum, _frame: signalled.append(time.time()))
    logger.info("booting", extra={"action": "booting"})
    deadline = time.monotonic() + MAX_LIFETIME_S
    ready_at = time.monotonic() + SLOW_BOOT_S
    while not signalled and time.monotonic() < ready_at:
        ctx.beat()
        time.sleep(0.01)
    if not signalled:
        logger.info("ready", extra={"action": "ready"})  # its time is before ctx.ready()
        ctx.ready()
    while not signalled and time.monotonic() < deadline:
        ctx.beat()
        time.sleep(0.01)
    if signalled:
        logger.info("terminating", extra={"action": "terminating", "signalled_at": signalled[0]})
    return 0


def crasher(ctx: ChildContext) -> int:
    """Raises out of its target: how its traceback reaches the log stream is under test."""
    ctx.ready()
    raise RuntimeError("crasher gave up")


def orphaner(ctx: ChildContext) -> int:
    """Forks a grandchild and exits at once: the grandchild is reparented to the subreaper."""
    ctx.ready()
    parent_title = _own_title()
    pid = os.fork()
    if pid == 0:
        set_title(parent_title.replace("orphaner", "grandchild"))
        time.sleep(GRANDCHILD_S)
        os._exit(0)
    logger.info("forked grandchild %d; exiting", pid, extra={"action": "orphaned"})
    return 0


def _own_title() -> str:
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def _chatty_tree() -> list[ChildSpec]:
    return [ChildSpec("chatty", chatty, count=3, shutdown_timeout_s=5.0)]


def _hang_tree() -> list[ChildSpec]:
    return [
        ChildSpec("hanger", hanger, liveness_timeout_s=HANG_LIVENESS_S, shutdown_timeout_s=5.0),
        ChildSpec("stubborn", stubborn, liveness_timeout_s=HANG_LIVENESS_S, shutdown_timeout_s=5.0),
    ]


def _orphan_tree() -> list[ChildSpec]:
    return [
        ChildSpec("orphaner", orphaner, restart=Restart.TEMPORARY, shutdown_timeout_s=5.0),
        ChildSpec("idle", idle, shutdown_timeout_s=5.0),
    ]


def _rolling_tree() -> list[ChildSpec]:
    return [ChildSpec("roller", slow_starter, count=2, rolling=True, shutdown_timeout_s=5.0)]


def _crash_tree() -> list[ChildSpec]:
    return [
        ChildSpec("crasher", crasher, restart=Restart.TEMPORARY, shutdown_timeout_s=5.0),
        ChildSpec("idle", idle, shutdown_timeout_s=5.0),
    ]


def _idle_tree() -> list[ChildSpec]:
    return [ChildSpec("idle", idle, shutdown_timeout_s=5.0)]


SCENARIOS: dict[str, Callable[[], list[ChildSpec]]] = {
    "idle": _idle_tree,
    "crash": _crash_tree,
    "rolling": _rolling_tree,
    "chatty": _chatty_tree,
    "hang": _hang_tree,
    "orphan": _orphan_tree,
}


def main(argv: list[str]) -> int:
    scenario, prefix = argv
    logs.configure("supervisor", "json", "DEBUG")
    set_title(f"{prefix}: supervisor")
    tree = Supervisor(
        SCENARIOS[scenario](),
        title_prefix=prefix,
        intensity=IntensityLimit(max_restarts=1000, period_s=60.0),
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        drain_timeout_s=10.0,
        child_setup=lambda label: logs.configure(label, "json", "DEBUG"),
    )
    return tree.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
