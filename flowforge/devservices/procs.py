"""Processes, files and ports of the private services (:mod:`flowforge.devservices`).

Every process is addressed by a pid this package recorded or read from its own pid file, never
by name; every wait is bounded; servers run as the ``postgres`` / ``rabbitmq`` accounts when
invoked as root (PostgreSQL refuses to run as root), else as the current user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowforge.errors import DevServiceError, DevServiceMissingError

logger = logging.getLogger(__name__)

#: The short names this package and the test harness raise and catch.
ServiceError = DevServiceError
ServiceUnavailable = DevServiceMissingError

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's, where /proc does not say

# --- timeouts (seconds) ----------------------------------------------------------------
KILL_WAIT_S = 10.0
ORPHAN_GRACE_S = 5.0
PORT_RELEASE_WAIT_S = 5.0
COMMAND_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.1


@dataclass(frozen=True)
class Account:
    """The OS account a service runs as; ``switch`` is False when no setuid is needed."""

    name: str
    uid: int
    gid: int
    switch: bool


def service_account(name: str, package: str) -> Account:
    """Return the account to run a server as: ``name`` when root, else the current user.

    Raises ServiceUnavailable (naming ``package``) when running as root and the
    account does not exist.
    """
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.geteuid())
        return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=False)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ServiceUnavailable(
            f"system user {name!r} not found; install the Debian package {package}"
        ) from None
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=True)


def require_executables(paths: Sequence[Path], package: str) -> None:
    """Raise ServiceUnavailable naming ``package`` unless every path is executable."""
    missing = [str(p) for p in paths if not os.access(p, os.X_OK)]
    if missing:
        raise ServiceUnavailable(
            f"missing {', '.join(missing)}; install the Debian package {package}"
        )


def which(name: str, package: str) -> Path:
    """Return the absolute path of executable ``name`` on PATH or raise ServiceUnavailable."""
    found = shutil.which(name)
    if found is None:
        raise ServiceUnavailable(f"{name} not found on PATH; install the Debian package {package}")
    return Path(found)


def _uid(account: Account) -> int | None:
    """Popen ``user``: the account's uid when switching, else None (keep ours)."""
    return account.uid if account.switch else None


def _gid(account: Account) -> int | None:
    """Popen ``group``: the account's gid when switching, else None (keep ours)."""
    return account.gid if account.switch else None


def _groups(account: Account) -> list[int] | None:
    """Popen ``extra_groups``: none at all when switching (drop root's), else unchanged."""
    return [] if account.switch else None


def run_command(
    argv: Sequence[str | Path],
    account: Account,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``account`` and return it finished; raise ServiceError on failure.

    Output is captured, so ``argv`` must not leave a daemon holding stdout/stderr.
    ``timeout`` is in seconds; a command still running then is killed and reported.
    """
    args = [str(a) for a in argv]
    logger.debug("running %s", args)
    try:
        result = subprocess.run(  # fixed argument list, no shell
            args,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            user=_uid(account),
            group=_gid(account),
            extra_groups=_groups(account),
        )
    except subprocess.TimeoutExpired:
        raise ServiceError(f"{Path(args[0]).name} did not finish within {timeout:.0f} s") from None
    if result.returncode != 0:
        detail = one_line(result.stderr or result.stdout)
        raise ServiceError(f"{Path(args[0]).name} {args[1:3]} failed: {detail}")
    return result


def spawn_detached(
    argv: Sequence[str | Path],
    account: Account,
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``account`` in its own session, output appended to ``log_path``."""
    args = [str(a) for a in argv]
    logger.debug("spawning %s", args)
    with log_path.open("ab") as log_file:
        chown(log_path, account)
        return subprocess.Popen(  # fixed argument list, no shell
            args,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=_uid(account),
            group=_gid(account),
            extra_groups=_groups(account),
        )


def one_line(text: str, limit: int = 400) -> str:
    """Collapse ``text`` to a single line of at most ``limit`` characters."""
    line = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line[:limit] if line else "(no output)"


def tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of ``path`` as one line ("" if the file is unreadable)."""
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return one_line("\n".join(content[-lines:]))


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie.

    Zombies count as dead: PID 1 on some machines never reaps orphans, so a killed
    daemon can linger as a zombie that ``kill(pid, 0)`` would still report as alive.
    """
    fields = proc_stat(pid)
    return fields is not None and bool(fields) and fields[0] not in ("Z", "X")


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (identifies it across pid reuse)."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def descendants(root_pid: int) -> dict[int, int | None]:
    """Live descendants of ``root_pid`` mapped to their start times (for later checks)."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        fields = proc_stat(pid)
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    found: dict[int, int | None] = {}
    pending = list(children.get(root_pid, []))
    while pending:
        pid = pending.pop()
        found[pid] = process_start_time(pid)
        pending.extend(children.get(pid, []))
    return found


def same_process_alive(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` is alive and still the process that had ``start_time``."""
    return pid_alive(pid) and process_start_time(pid) == start_time


def reap_descendants(procs: Mapping[int, int | None]) -> None:
    """Give ``procs`` (from ``descendants``) ORPHAN_GRACE_S to exit, then SIGKILL them."""
    try:
        wait_until(
            lambda: not any(same_process_alive(p, t) for p, t in procs.items()),
            ORPHAN_GRACE_S,
            "child processes to exit",
        )
    except ServiceError:
        for pid, start_time in procs.items():
            if same_process_alive(pid, start_time):
                logger.warning("SIGKILL leftover child %s %s", pid, proc_cmdline(pid))
                kill_and_wait(pid)


def proc_cmdline(pid: int) -> list[str]:
    """The argv of process ``pid`` ([] if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def proc_cwd(pid: int) -> Path | None:
    """The working directory of process ``pid`` (None if gone, a zombie or unreadable)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def all_pids() -> Iterator[int]:
    """Every pid currently listed in /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def read_pid_file(path: Path) -> int | None:
    """The pid on the first line of ``path`` (None if missing or malformed)."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every POLL_INTERVAL_S until true; ServiceError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise ServiceError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


def kill_and_wait(pid: int, timeout: float = KILL_WAIT_S) -> None:
    """SIGKILL ``pid`` (which the caller has identified as ours) and wait for it to die."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout, f"pid {pid} to exit after SIGKILL")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (first, last)."""
    try:
        first, last = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


def port_in_use(port: int) -> bool:
    """True if 127.0.0.1:``port`` cannot be bound (something already listens there).

    Binding (never connecting) means no other service is contacted by the check.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def port_accepts(port: int) -> bool:
    """True if a TCP connection to 127.0.0.1:``port`` succeeds within CONNECT_TIMEOUT_S."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def ensure_ports_free(ports: Mapping[str, int]) -> None:
    """Raise ServiceError naming the first of ``ports`` (label -> port) already in use."""
    for label, port in ports.items():
        if port_in_use(port):
            raise ServiceError(f"{label} port {port} on {LOOPBACK} is already in use")


def wait_ports_free(ports: Mapping[str, int]) -> None:
    """Wait up to PORT_RELEASE_WAIT_S for ``ports`` (label -> port) to be released.

    A SIGKILLed server's listening socket can outlive its process by some milliseconds.
    Raises ServiceError like ``ensure_ports_free`` if a port is still taken afterwards.
    """
    with contextlib.suppress(ServiceError):
        wait_until(
            lambda: not any(port_in_use(p) for p in ports.values()),
            PORT_RELEASE_WAIT_S,
            "ports to be released",
        )
    ensure_ports_free(ports)


def chown(path: Path, account: Account) -> None:
    """Give ``path`` to ``account`` when servers run under a different account."""
    if account.switch:
        os.chown(path, account.uid, account.gid)


def ensure_base_dir(base_dir: Path) -> None:
    """Create ``base_dir`` itself (never its parents, which must already exist)."""
    if not base_dir.parent.is_dir():
        raise ServiceError(f"parent directory of base dir {base_dir} does not exist")
    base_dir.mkdir(mode=0o755, exist_ok=True)


def make_dirs(account: Account, *dirs: Path) -> None:
    """Create ``dirs`` (mode 0755 where new) owned by ``account``; parents are not chowned."""
    for directory in dirs:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        chown(directory, account)


def write_file(path: Path, content: str, account: Account, mode: int = 0o644) -> None:
    """Write ``content`` to ``path`` with ``mode``, owned by ``account``."""
    path.write_text(content)
    path.chmod(mode)
    chown(path, account)


def _account_groups(account: Account) -> set[int]:
    """The group ids ``account`` belongs to (primary and supplementary)."""
    return set(os.getgrouplist(account.name, account.gid))


def _can_traverse(path: Path, account: Account, groups: set[int]) -> bool:
    """True if ``account`` (member of ``groups``) may search directory ``path``."""
    info = path.stat()
    if info.st_uid == account.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in groups:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def check_traversable(path: Path, account: Account) -> None:
    """Raise ServiceError unless ``account`` can reach ``path`` through every ancestor.

    Only matters when switching accounts: e.g. pytest's tmp dirs are mode 0700 root.
    """
    if not account.switch:
        return
    groups = _account_groups(account)
    for ancestor in [path, *path.parents]:
        if ancestor.exists() and not _can_traverse(ancestor, account, groups):
            raise ServiceError(
                f"user {account.name} cannot traverse {ancestor}; "
                "use a base dir whose ancestors are searchable (e.g. mode 0755)"
            )


def process_env(extra: Mapping[str, str]) -> dict[str, str]:
    """A minimal child environment: PATH and a UTF-8 locale plus ``extra``.

    The caller's environment is deliberately not inherited so stray RABBITMQ_*, PG*
    or ERL_* variables cannot redirect a private instance at shared resources.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env
