"""``flowforge up`` trees for real-process tests: each with its stderr in a log file, stopped
(or SIGKILLed) by pid; the ``trees`` fixture (tests/integration/conftest.py) stops every one a
test started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.e2e import REPO
from tests.harness.resources import child_pids
from tests.helpers import wait_for

READY_S = 60.0
STOP_S = 30.0


class Tree:
    """One ``flowforge up`` (optionally under ``faketime``) with its stderr in a log file.

    ``env`` (default: this process's without any ``FLOWFORGE_`` variable: the config alone says
    where things are) is the tree's environment."""

    def __init__(
        self,
        config: Path,
        log: Path,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        if env is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
        self.log_path = log
        self.prefix = tuple(prefix)
        with log.open("ab") as stderr:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
                cwd=REPO,
                env=dict(env),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> None:
        def probe() -> bool:
            assert self.proc.poll() is None, f"the tree exited:\n{self.log()[-3000:]}"
            return "tree ready" in self.log()

        wait_for(probe, READY_S, 0.1, "the tree to be ready")

    def supervisor(self) -> int:
        """The supervisor's pid: the process started, or — under a wrapper such as ``faketime``,
        which forks the command and waits for it — the wrapper's child. Signalling the wrapper
        would end it alone and leave the tree running, orphaned, for the tests after this one."""
        if not self.prefix:
            return self.proc.pid
        children = child_pids(self.proc.pid)
        return children[0] if children else self.proc.pid

    def stop(self) -> None:
        """SIGTERM the supervisor and wait for the whole tree (SIGKILL after STOP_S)."""
        if self.proc.poll() is None:
            os.kill(self.supervisor(), signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the supervisor; its children die with it (PR_SET_PDEATHSIG)."""
        supervisor = self.supervisor()
        children = child_pids(supervisor, recursive=True)
        os.kill(supervisor, signal.SIGKILL)
        self.proc.wait(STOP_S)
        wait_for(lambda: not any(alive(p) for p in children), STOP_S, 0.05, "children to die")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped between the two
        return False
    return stat.split()[2] != "Z"
