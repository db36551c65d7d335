"""The `flowforge` command without an interpreter start per call: a preloaded copy forks.

A CLI test used to pay for ``python -m flowforge.cli`` in a fresh subprocess every time:
starting the interpreter and importing the CLI, psycopg and the store take 0.3 s on a quiet
2-core machine and over a second on a busy one, which made the command tests the slowest of
the fast loop. :func:`run` gives the same :class:`subprocess.CompletedProcess` (exit code,
stdout and stderr decoded as ``subprocess.run(..., text=True)`` decodes them) from a process
forked off a server that imported those modules once, so each call costs a fork.

The command still runs in a process of its own, as ``python -m flowforge.cli`` does: runpy
executes ``flowforge/cli/__main__.py`` with ``sys.argv`` set, a ``SystemExit`` becomes the
exit status the interpreter would give, atexit handlers run and the streams are flushed; the
child gets its own environment (``os.environ`` replaced), working directory (also
``sys.path[0]``, as ``-m`` sets it), stdin on /dev/null and file descriptors 1 and 2 on files
the test reads. Nothing it does (``logging.disable``, imported handler modules, a changed
``sys.path``) reaches the test process or the next command. What a fork cannot prove — the
interpreter's own start and the ``flowforge`` console script — tests/integration/test_cli.py
and tests/unit/test_cli_version.py prove with real subprocesses, and so does any call whose
environment changes how an interpreter starts (``PYTHON*``, ``LANG``, ``LC_*``): :func:`run`
falls back to a real subprocess for those.

The server is ``python -m tests.cli_runner``, started on first use with this process's
environment and stopped when this process exits (it also exits when its socket closes).
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: What the server imports once: the CLI and what its commands import when they run.
PRELOAD = (
    "flowforge.cli.main",
    "flowforge.cli.commands",
    "flowforge.cli.purge",
    "flowforge.client",
    "flowforge.store.migrate",
)
#: Environment variables read while an interpreter starts: a call that changes one of them
#: from the server's environment gets a real subprocess.
STARTUP_VARIABLES = ("PYTHON", "LANG", "LC_")
MESSAGE_BYTES = 1 << 20
SERVER_BOOT_TIMEOUT_S = 60.0
KILL_GRACE_S = 10.0


# ------------------------------------------------------------------ the test's side


def run(
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: str | Path | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """``python -m flowforge.cli *args`` with ``env`` in ``cwd`` (default: this process's),
    as ``subprocess.run(..., capture_output=True, text=True, check=False)`` would return it.

    Raises :class:`subprocess.TimeoutExpired` (after killing the command) past ``timeout``
    seconds.
    """
    workdir = str(cwd if cwd is not None else os.getcwd())
    if _startup_differs(env):
        return subprocess.run(
            [sys.executable, "-m", "flowforge.cli", *args],
            capture_output=True,
            text=True,
            env=dict(env),
            cwd=workdir,
            timeout=timeout,
            check=False,
        )
    return _server().run(list(args), dict(env), workdir, timeout)


def run_config(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``flowforge -c CONFIG ARGS`` from the repository, as an operator runs it: no
    ``FLOWFORGE_`` variable of this process reaches it (the config alone says where things
    are)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    return run(["-c", str(config), *args], env, cwd=REPO)


def assert_ok(result: subprocess.CompletedProcess[str]) -> str:
    """A command that succeeded: exit 0, nothing on stderr. Returns its stdout."""
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stderr == ""
    return result.stdout


def assert_refused(result: subprocess.CompletedProcess[str], code: int, fragment: str) -> str:
    """A refusal as the CLI contract says: exit ``code``, exactly one line on stderr holding
    ``fragment``, no traceback. Returns that line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert fragment in line and "Traceback" not in line, line
    return line


def _startup_differs(env: Mapping[str, str]) -> bool:
    def startup(variables: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in variables.items() if k.startswith(STARTUP_VARIABLES)}

    return startup(env) != startup(_SERVER_ENV)


def _decoded(data: bytes) -> str:
    """What ``subprocess.run(..., text=True)`` makes of a stream: the locale's encoding,
    universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _Server:
    """The parent's end of one ``python -m tests.cli_runner`` server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_runner", str(theirs.fileno())],
            cwd=REPO,
            env=_SERVER_ENV,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._receive(SERVER_BOOT_TIMEOUT_S, "the server to import the CLI")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(
        self, args: list[str], env: dict[str, str], cwd: str, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        # as bytes, the way an exec passes them: what the OS cannot carry fails here, as
        # subprocess would fail, and the child decodes them as the interpreter decodes argv
        request = json.dumps(
            {
                "args": [_bytes_text(a) for a in args],
                "env": {_bytes_text(k): _bytes_text(v) for k, v in env.items()},
                "cwd": _bytes_text(cwd),
            }
        ).encode()
        with (
            open(os.devnull, "rb") as stdin,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
        ):
            socket.send_fds(self._sock, [request], [stdin.fileno(), out.fileno(), err.fileno()])
            deadline = time.monotonic() + timeout
            pid = int(self._receive(timeout, "the fork")["pid"])
            try:
                code = int(self._receive(deadline - time.monotonic(), "the command")["code"])
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._receive(KILL_GRACE_S, "the killed command to be reaped")
                raise subprocess.TimeoutExpired(
                    ["flowforge", *args], timeout, _read(out), _read(err)
                ) from None
            return subprocess.CompletedProcess(
                [sys.executable, "-m", "flowforge.cli", *args],
                code,
                _decoded(_read(out)),
                _decoded(_read(err)),
            )

    def close(self) -> None:
        self._sock.close()  # the server's next receive sees the end and it exits
        try:
            self._proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(KILL_GRACE_S)

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        self._sock.settimeout(max(timeout, 0.001))
        try:
            data = self._sock.recv(MESSAGE_BYTES)
        except TimeoutError:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}") from None
        if not data:
            raise RuntimeError(f"the CLI server exited (code {self._proc.wait(KILL_GRACE_S)})")
        reply: dict[str, Any] = json.loads(data)
        return reply


def _bytes_text(text: str) -> str:
    """``text`` as the bytes an exec would pass, carried in JSON (one char per byte)."""
    return os.fsencode(text).decode("latin-1")


def _text(carried: str) -> str:
    """The child's side of :func:`_bytes_text`: bytes decoded as ``sys.argv`` is."""
    return os.fsdecode(carried.encode("latin-1"))


def _read(file: Any) -> bytes:
    file.seek(0)
    data: bytes = file.read()
    return data


_SERVER_ENV = dict(os.environ)
_server_instance: _Server | None = None


def _server() -> _Server:
    global _server_instance
    if _server_instance is None or not _server_instance.alive():
        _server_instance = _Server()
        atexit.register(_server_instance.close)
    return _server_instance


# ------------------------------------------------------------------ the server's side


def serve(sock: socket.socket) -> None:
    """Fork a child per request until the socket closes; reply with its pid, then its
    exit status (negative: the signal that ended it, as :mod:`subprocess` reports)."""
    sock.send(b"{}")  # imported: ready
    while True:
        message, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 3)
        if not message:
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            sock.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        cwd = _text(request["cwd"])
        os.chdir(cwd)
        sys.path[0] = cwd  # what ``python -m`` puts first
        os.environ.clear()
        os.environ.update({_text(k): _text(v) for k, v in request["env"].items()})
        sys.argv = ["-m", *map(_text, request["args"])]  # runpy sets argv[0] to the file
        code = _run_cli()
    finally:
        os._exit(code)


def _run_cli() -> int:
    """Run ``flowforge.cli`` as ``__main__``; the exit status the interpreter would give."""
    import atexit as exits
    import runpy
    import traceback

    try:
        runpy.run_module("flowforge.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # as the interpreter does: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    exits._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def _exit_status(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    serve(socket.socket(fileno=int(sys.argv[1])))
