"""Podman as the container tests drive it, on this kind of machine.

Every call passes ``--runtime runc`` (crun refuses this host's hybrid cgroup layout; override
with ``$PODMAN_RUNTIME``) and every ``run`` explicit ulimits: podman's defaults exceed the
hard limits here, and runc then cannot start the container. Nothing in /etc is changed.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

RUNTIME = os.environ.get("PODMAN_RUNTIME", "runc")
#: podman's own commands (stop, rm, build) are bounded by this (seconds) unless told otherwise.
COMMAND_TIMEOUT_S = 120.0
NPROC_CAP = 32768


def missing_tools() -> list[str]:
    """What the container tests need and this machine lacks (scripts/bootstrap installs it)."""
    missing = [t for t in ("podman", RUNTIME, "mmdebstrap") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root (rootful podman)")
    return missing


def ulimit_args() -> list[str]:
    """``--ulimit`` options within this host's hard limits (nproc at most 32768)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if nproc == resource.RLIM_INFINITY or nproc > NPROC_CAP:
        nproc = NPROC_CAP
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


class PodmanError(AssertionError):
    """A podman command failed: its command line, exit code and stderr."""


def run_podman(
    *args: str, timeout: float = COMMAND_TIMEOUT_S, merge: bool = False
) -> subprocess.CompletedProcess[str]:
    """``podman --runtime RUNTIME ARGS``, its output captured, whatever its exit code;
    ``merge``: stderr into stdout, in order."""
    return subprocess.run(
        ["podman", "--runtime", RUNTIME, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )


def podman(*args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """``podman --runtime RUNTIME ARGS``'s stdout; :class:`PodmanError` on a non-zero exit."""
    done = run_podman(*args, timeout=timeout)
    if done.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


@dataclass(frozen=True)
class Proc:
    """One process of a container, as ``podman top`` shows it (pid in the container's pid
    namespace, hpid on the host)."""

    pid: int
    ppid: int
    hpid: int
    state: str
    args: str


def host_start_time(hpid: int) -> int | None:
    """The host process's start time (clock ticks since boot), None when it is gone: a pid with
    another start time is another process that reused the number."""
    try:
        stat = Path(f"/proc/{hpid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Container:
    """A container this test run created, by its unique name, and the podman secrets made
    for it."""

    name: str
    secrets: tuple[str, ...] = ()

    def top(self) -> list[Proc]:
        out = podman("top", self.name, "pid", "ppid", "hpid", "state", "args")
        procs = []
        for line in out.splitlines()[1:]:
            pid, ppid, hpid, state, args = line.split(maxsplit=4)
            procs.append(Proc(int(pid), int(ppid), int(hpid), state, args.strip()))
        return procs

    def logs(self) -> str:
        """What the container wrote: ``podman logs`` gives its stdout (``flowforge up``'s
        banner) and its stderr (the tree's log lines) on its own two streams."""
        done = run_podman("logs", self.name, merge=True)
        if done.returncode != 0:
            raise PodmanError(f"podman logs {self.name}: exit {done.returncode}: {done.stdout}")
        return done.stdout

    def state(self) -> tuple[str, int]:
        """(status, exit code) as ``podman inspect`` reports them."""
        out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.name)
        status, code = out.split()
        return status, int(code)

    def container_id(self) -> str:
        return podman("inspect", "--format", "{{.Id}}", self.name).strip()

    def healthcheck(self) -> bool:
        """The image's HEALTHCHECK, run now (no systemd here to run it on a timer)."""
        return run_podman("healthcheck", "run", self.name, timeout=30).returncode == 0

    def stop(self) -> float:
        """``podman stop`` (the container's own stop timeout); the seconds it took."""
        started = time.monotonic()
        podman("stop", self.name)
        return time.monotonic() - started

    def remove(self) -> None:
        """The container, whatever its state, then its secrets."""
        run_podman("rm", "--force", "--time", "0", self.name)
        for secret in self.secrets:
            run_podman("secret", "rm", secret)
