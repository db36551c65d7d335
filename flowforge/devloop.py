"""The loop of ``flowforge dev``: run the tree, reload it when the code changes.

The tree is ``flowforge up`` in a child process of its own process group (so a Ctrl-C reaches
``flowforge dev`` alone, which forwards it once: a Ctrl-C in the terminal would otherwise reach
the tree too, and two stops are the supervisor's fast stop). A reload is what SIGHUP does to
``flowforge up``: a rolling restart of the workers, the scheduler and the api, each new child
loading the handler modules and workflow files afresh and ready before the old one stops, so no
task is lost to a reload.

Before every reload (and before starting the tree) the handlers and workflows are checked in a
fresh interpreter (``flowforge workflows validate``, which imports the handler modules as a
worker does): a file that does not load — a syntax error, an import that fails — is reported in
one line and the tree keeps the children it has; a worker that failed to import its handlers
would fail to boot, which stops that reload (and, outside a reload, the whole tree:
docs/failure-model.md, modes 98 and 99).
Should the tree stop anyway, ``flowforge dev`` says so and starts it again on the next change.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flowforge.config import (
    ENV_BROKER_PASSWORD_FILE,
    ENV_BROKER_URL,
    ENV_BROKER_URL_FILE,
    ENV_DATABASE_PASSWORD_FILE,
    ENV_DATABASE_URL,
    ENV_DATABASE_URL_FILE,
    FILE_SUFFIX,
)
from flowforge.orphans import stop_with_parent
from flowforge.text import escape

#: How long the check of the code may take (seconds): importing the handler modules.
CHECK_TIMEOUT_S = 120.0
#: After the first stop is forwarded, how long beyond the tree's own drain timeout to wait
#: before a second (the supervisor's fast stop), and as long again before SIGKILL (seconds).
STOP_GRACE_S = 10.0
#: Changed files named in a reload's line; the rest are counted.
NAMED_FILES = 3


class Tree(Protocol):
    """A running tree, as the loop sees it."""

    def poll(self) -> int | None: ...
    def send(self, signum: int) -> None: ...


class TreeProcess:
    """``flowforge up -c CONFIG`` in a process group of its own; addressed by its pid only."""

    def __init__(self, config_path: Path, env: Mapping[str, str]) -> None:
        self._proc = subprocess.Popen(  # fixed argument list, no shell
            cli_argv(config_path, "up"),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            process_group=0,
            preexec_fn=stop_with_parent,  # no thread runs in flowforge dev: safe
        )
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def send(self, signum: int) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signum)


def cli_argv(config_path: Path, *args: str) -> list[str]:
    """The ``flowforge`` command line, run by this interpreter, on ``config_path``."""
    return [sys.executable, "-m", "flowforge.cli", "-c", str(config_path), *args]


def check_code(
    config_path: Path, env: Mapping[str, str], timeout_s: float = CHECK_TIMEOUT_S
) -> str | None:
    """None when the handlers and workflows load in a fresh interpreter; else the first line of
    what ``flowforge workflows validate`` said about them (escaped)."""
    try:
        done = subprocess.run(  # fixed argument list, no shell
            cli_argv(config_path, "workflows", "validate"),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"loading the handlers took more than {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    said = [line.strip() for line in (done.stderr + "\n" + done.stdout).splitlines()]
    first = next((line for line in said if line), f"exit code {done.returncode}")
    return escape(first.removeprefix("flowforge: "))


def describe(paths: Iterable[Path], base: Path) -> str:
    """``a.py, b.py and 2 more``: changed files, relative to ``base`` where they are under it."""
    names = sorted(str(p.relative_to(base)) if p.is_relative_to(base) else str(p) for p in paths)
    shown = ", ".join(escape(n) for n in names[:NAMED_FILES])
    more = len(names) - NAMED_FILES
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass
class StopSignals:
    """SIGINT and SIGTERM, counted (a handler that only counts: the loop acts on them)."""

    count: int = 0
    wake: Callable[[], None] = field(default=lambda: None)

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        self.wake()


@dataclass
class DevLoop:
    """Watch, check, reload; forward stops. Every effect goes through a seam (the unit tests'
    stand-ins): ``start_tree``, ``check`` (None or the problem), ``changes`` (the watcher's
    poll), ``wait`` (sleep up to N seconds, woken early by a stop), ``clock``, ``say``."""

    start_tree: Callable[[], Tree]
    check: Callable[[], str | None]
    changes: Callable[[], frozenset[Path]]
    wait: Callable[[float], None]
    clock: Callable[[], float]
    say: Callable[[str], None]
    stops: StopSignals
    config_path: Path
    drain_timeout_s: float
    interval_s: float = 0.5
    tree: Tree | None = None
    reloads: int = 0

    def run(self) -> int:
        """Until a stop: the tree's exit code when it stopped, 0 when none ran."""
        self._start_if_loadable("the tree did not start")
        forwarded, deadline, code = 0, float("inf"), 0
        while True:
            if self.tree is not None:
                exited = self.tree.poll()
                if exited is not None:
                    self.tree, code = None, exited
                    if not self.stops.count:
                        self.say(f"the tree exited ({exited}); save a file to start it again")
            if self.stops.count:
                if self.tree is None:
                    return code
                if forwarded < self.stops.count or self.clock() > deadline:
                    forwarded, deadline = self._forward_stop(forwarded, deadline)
            else:
                self._on_changes(self.changes())
            self.wait(self.interval_s)

    def _forward_stop(self, forwarded: int, deadline: float) -> tuple[int, float]:
        assert self.tree is not None
        now = self.clock()
        if forwarded >= 2 and now > deadline:
            self.say("the tree did not stop; SIGKILL")
            self.tree.send(signal.SIGKILL)
            return forwarded, float("inf")
        self.tree.send(signal.SIGTERM)  # the second one is the supervisor's fast stop
        wait = self.drain_timeout_s + STOP_GRACE_S if forwarded == 0 else STOP_GRACE_S
        return forwarded + 1, now + wait

    def _on_changes(self, changed: frozenset[Path]) -> None:
        if not changed:
            return
        if self.config_path in changed:
            self.say("the config changed: restart flowforge dev to apply it (a reload keeps it)")
            changed = changed - {self.config_path}
            if not changed:
                return
        what = describe(changed, self.config_path.parent)
        if self.tree is None:
            self._start_if_loadable(f"changed: {what}; still not started")
            return
        problem = self.check()
        if problem is not None:
            self.say(f"not reloaded ({what}): {problem}; the tree keeps the code it loaded")
            return
        self.tree.send(signal.SIGHUP)
        self.reloads += 1
        self.say(f"reload {self.reloads}: {what} changed; rolling restart")

    def _start_if_loadable(self, failed: str) -> None:
        problem = self.check()
        if problem is not None:
            self.say(f"{failed}: {problem}; fix it and save to start the tree")
            return
        self.tree = self.start_tree()


def install_stop_handlers(stops: StopSignals) -> Callable[[], None]:
    """Count SIGINT and SIGTERM in ``stops``; returns what puts the previous handlers back."""
    previous = {s: signal.signal(s, stops) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def tree_environment(
    base: Mapping[str, str], urls: Sequence[str] | None, token: tuple[str, str] | None
) -> dict[str, str]:
    """The tree's environment: ``base`` with the private services' ``(database, broker)``
    ``urls`` (their ``*_FILE`` variables and password files dropped: the private servers trust
    127.0.0.1, and a file would conflict with the URL) and a dev api ``token`` as ``(variable,
    value)`` (its ``_FILE`` variable dropped)."""
    env = dict(base)
    if urls is not None:
        for name in (
            ENV_DATABASE_URL_FILE,
            ENV_DATABASE_PASSWORD_FILE,
            ENV_BROKER_URL_FILE,
            ENV_BROKER_PASSWORD_FILE,
        ):
            env.pop(name, None)
        env[ENV_DATABASE_URL], env[ENV_BROKER_URL] = urls
    if token is not None:
        env.pop(token[0] + FILE_SUFFIX, None)
        env[token[0]] = token[1]
    return env


def dev_token(state_dir: Path) -> str:
    """The project's dev api token: made once (random, ``state_dir/api-token``, mode 0600)."""
    path = state_dir / "api-token"
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        token = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
    return token
