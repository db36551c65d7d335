"""``flowforge up`` validates the config, then becomes ``python -m flowforge.tree`` (same pid).

The new interpreter holds none of the command line's modules, so neither do the supervisor and
the children it forks (docs/performance.md, "Memory"). The whole tree's behaviour through this
entry is proven by every test that runs ``flowforge up`` (tests/chaos/test_supervisor.py checks
the supervisor keeps the pid it was started with); here, the entry itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main
from flowforge.config import ConfigSource, config_from, load_config, read_config
from flowforge.tree import SECRETS_FD_ENV, _handover, _take_handover, become_tree
from tests.helpers import modules_after_importing


@pytest.fixture(autouse=True)
def _signal_mask() -> Iterator[None]:
    """``flowforge up`` blocks SIGTERM and SIGINT for the tree it becomes; a test that stops it
    before the exec must not leave them blocked in the test process."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_the_tree_entry_loads_none_of_the_command_line_and_no_yaml() -> None:
    loaded = modules_after_importing("flowforge.tree", "flowforge.up")
    assert "argparse" not in loaded
    assert {m for m in loaded if m.startswith("flowforge.cli.")} == {"flowforge.cli.exitcodes"}
    assert not {m for m in loaded if m == "yaml" or m.startswith(("yaml.", "_yaml"))}


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "usage: python -P -m flowforge.tree"), (["x.yaml", "", "/nonexistent/x.yaml"], "x.yaml")],
)
def test_the_tree_entry_refuses_bad_arguments_with_one_line_and_2(
    args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.tree", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == exitcodes.USAGE
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowforge: ") and message in lines[0]


def test_up_validates_the_config_then_becomes_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    became: list[tuple[str | None, str]] = []

    def fake_become_tree(_config: object, _source: object, path: str | None, label: str) -> None:
        became.append((path, label))
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert {signal.SIGTERM, signal.SIGINT} <= blocked, "a stop could be lost before the tree"
        raise SystemExit(0)  # os.execv does not return either

    monkeypatch.setattr("flowforge.tree.become_tree", fake_become_tree)
    good = tmp_path / "good.yaml"
    good.write_text("processes:\n  workers: 2\n")
    with pytest.raises(SystemExit):
        main(["-c", str(good), "up"])
    assert became == [(str(good), "good.yaml")]

    bad = tmp_path / "bad.yaml"
    bad.write_text("processes:\n  workers: many\n")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])
    assert main(["-c", str(bad), "up"]) == exitcodes.USAGE
    assert len(became) == 1, "a bad config must not start anything"
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "left blocked"


def test_up_names_the_config_from_the_environment_when_no_option_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container image runs plain ``flowforge up`` with $FLOWFORGE_CONFIG set: the tree
    reads that file again and its title names it, not "defaults"."""
    became: list[tuple[str | None, str]] = []

    def fake_become_tree(_config: object, _source: object, path: str | None, label: str) -> None:
        became.append((path, label))
        raise SystemExit(0)

    monkeypatch.setattr("flowforge.tree.become_tree", fake_become_tree)
    config = tmp_path / "config.yaml"
    config.write_text("processes:\n  workers: 2\n")
    monkeypatch.setenv("FLOWFORGE_CONFIG", str(config))
    with pytest.raises(SystemExit):
        main(["up"])
    assert became == [(str(config), "config.yaml")]


def test_up_runs_the_tree_in_its_own_process_when_no_interpreter_can_be_executed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))  # execv: OSError
    monkeypatch.setattr("flowforge.up.run", lambda _config, label: ran.append(label) or 0)
    config = tmp_path / "here.yaml"
    config.write_text("processes:\n  workers: 1\n")
    assert main(["-c", str(config), "up"]) == exitcodes.OK
    assert ran == ["here.yaml"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flowforge: no fresh interpreter (") and "running the tree here" in line


# ------------------------------------------------------------------ started with stops blocked

STOP = [signal.SIGTERM, signal.SIGINT]


def _raise_here(signum: int) -> None:
    """``signum`` sent to this thread, which blocks it: pending here until unblocked, as in a
    process of one thread (the image's entrypoint). Sent to the process instead
    (``raise_signal``), any other thread of the test runner that does not block it (pytest-xdist
    has some) takes it at once, and the test measured that race instead."""
    signal.pthread_kill(threading.get_ident(), signum)


def _take_pending(signum: int) -> bool:
    """Whether ``signum`` was pending (it is no longer): so the test leaves none behind."""
    return signal.sigtimedwait([signum], 0) is not None


@pytest.mark.parametrize("command", [["up"], ["role", "worker"]], ids=["up", "role"])
def test_up_and_role_started_with_a_stop_pending_keep_it_pending_for_their_handlers(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's entrypoint execs `flowforge up` with SIGTERM/SIGINT blocked: a stop that came
    during the interpreter's start must still be pending at the exec into the tree (its
    handlers take it there), not delivered on the way (as PID 1: dropped). The same for
    `flowforge role`, whose handlers come with its stop event."""
    seen: list[tuple[set[int], set[int]]] = []

    def handlers_next(*_args: object) -> int:
        seen.append((signal.pthread_sigmask(signal.SIG_BLOCK, []), signal.sigpending()))
        raise SystemExit(0)

    monkeypatch.setattr("flowforge.tree.become_tree", handlers_next)
    monkeypatch.setattr("flowforge.boot.run", handlers_next)
    monkeypatch.setattr("supervisor.logs.configure", lambda *_args: None)
    config = tmp_path / "c.yaml"
    config.write_text("processes:\n  workers: 1\n")
    delivered: list[int] = []  # here, not the default action (which would end pytest)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: delivered.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP)
    _raise_here(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            main(["-c", str(config), *command])
    finally:
        pending = _take_pending(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    assert pending and not delivered, "the stop was delivered before the handlers existed"
    ((blocked, pending_then),) = seen
    assert set(STOP) <= blocked and signal.SIGTERM in pending_then


def test_any_other_command_started_with_the_stop_signals_blocked_unblocks_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`podman run IMAGE migrate` (or any command but `up` and `role`) starts blocked as well;
    it must stop on SIGTERM/SIGINT as any command does, a SIGINT that came meanwhile included."""
    masks: list[set[int]] = []
    monkeypatch.setattr(
        "flowforge.cli.commands.workflows_list",
        lambda _args: masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])) or 0,
    )
    config = tmp_path / "c.yaml"
    config.write_text("processes:\n  workers: 1\n")
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP)
    assert main(["-c", str(config), "workflows", "list"]) == exitcodes.OK
    assert masks and not set(STOP) & masks[0]

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP)
    # a process's own SIGINT handler, whatever the test runner left installed in this one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _raise_here(signal.SIGINT)
    try:
        code = main(["-c", str(config), "workflows", "list"])
    finally:
        left = _take_pending(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
    assert (code, left, len(masks)) == (130, False, 1), "the pending SIGINT must interrupt it"
    assert capsys.readouterr().err == "flowforge: interrupted\n"


# ------------------------------------------------------------------ secrets across the exec

SECRET_ENV = {
    "FLOWFORGE_DATABASE_URL": "postgresql://ff:db-s3cret@db/flowforge",
    "FLOWFORGE_BROKER_URL": "amqp://ff:mq-s3cret@mq/%2F",
    "FLOWFORGE_API_TOKEN": "tok-s3cret",
}


def exec_of_become_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> tuple[list[str], dict[str, str], bytes | None]:
    """What ``become_tree`` hands ``os.execve`` under ``env``: argv, the environment and the
    content of the descriptor it names (None when it names none)."""
    for name in [k for k in os.environ if k.startswith("FLOWFORGE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config_path = tmp_path / "c.yaml"
    config_path.write_text("api:\n  listen: 127.0.0.1:8080\n")
    source = read_config(config_path)
    config = config_from(source)
    execs: list[tuple[list[str], dict[str, str], bytes | None]] = []

    def fake_execve(_path: str, argv: list[str], new_env: dict[str, str]) -> Any:
        fd = new_env.get(SECRETS_FD_ENV)
        data = None
        if fd is not None:
            assert os.get_inheritable(int(fd)), "the new interpreter could not read it"
            data = os.pread(int(fd), 1 << 16, 0)
        execs.append((argv, new_env, data))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(SystemExit):
        become_tree(config, source, str(config_path), "c.yaml")
    (found,) = execs
    return found


def test_secret_variables_cross_the_exec_in_a_memory_file_not_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, env, data = exec_of_become_tree(
        tmp_path, monkeypatch, {**SECRET_ENV, "FLOWFORGE_API_TOKEN_FILE_UNUSED": "/run/x"}
    )
    assert argv[-1].endswith("c.yaml") and "flowforge.tree" in argv
    assert data is not None and json.loads(data)["secrets"] == SECRET_ENV
    for name in SECRET_ENV:
        assert name not in env
    assert env["FLOWFORGE_API_TOKEN_FILE_UNUSED"] == "/run/x"  # the rest crosses as it was
    assert "s3cret" not in json.dumps(env)


def test_without_secret_variables_the_memory_file_holds_the_config_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, env, data = exec_of_become_tree(tmp_path, monkeypatch, {})
    assert data is not None and env[SECRETS_FD_ENV].isdigit()
    handed = json.loads(data)
    assert handed["secrets"] == {}
    assert handed["config"] == {
        "data": {"api": {"listen": "127.0.0.1:8080"}},
        "base_dir": str(tmp_path.resolve()),
        "where": str(tmp_path / "c.yaml"),
    }


def test_the_tree_validates_the_handed_document_as_the_file_and_reads_no_yaml(
    tmp_path: Path,
) -> None:
    """The tree validates the document ``flowforge up`` read, with the environment's secrets,
    into the config ``load_config`` makes of the file — relative paths under the file's
    directory — and never parses YAML to do it (PyYAML out of the supervisor)."""
    (tmp_path / "flows").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(
        "workflows: [flows]\nprocesses: {workers: 3}\nbroker: {url: amqp://mq/%2F}\n"
        "api: {listen: 127.0.0.1:8080}\nevents: {retention: 2d}\n"
    )
    env = {"FLOWFORGE_DATABASE_URL": "postgresql://ff:s3cret@db/ff", "FLOWFORGE_API_TOKEN": "t"}
    handed = _handover({}, read_config(path, env))
    fd = memory_file(handed)
    code = (
        "import json, sys\n"
        "from flowforge.tree import _take_handover\n"
        "from flowforge.config import config_from\n"
        f"secrets, source = _take_handover({{'FLOWFORGE_SECRETS_FD': '{fd}'}})\n"
        f"config = config_from(source, {env!r})\n"
        "print(json.dumps([repr(config), 'yaml' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, pass_fds=(fd,)
    )
    os.close(fd)
    assert done.returncode == 0, done.stderr
    validated, parsed_yaml = json.loads(done.stdout)
    assert validated == repr(load_config(path, env)) and not parsed_yaml


@pytest.mark.parametrize(
    "text", ["processes: {workers: 2}\nnote: 2024-01-01\n", "processes: {workers: 2}\n1: x\n"]
)
def test_a_document_json_cannot_carry_exactly_is_left_to_the_tree_to_read_again(
    text: str, tmp_path: Path
) -> None:
    """A YAML date, or a key that is not text, would not come back from JSON as it was read:
    the config is not handed over, and the tree reads the file (and refuses it) itself."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert "config" not in json.loads(_handover({}, read_config(path)))


def test_a_document_nested_deeper_than_json_goes_or_holding_a_nan_is_left_to_the_tree() -> None:
    """The family of the inexact documents that does not come from a YAML file's text alone:
    a NaN (JSON gives it back, but not equal to itself) and a nesting deeper than the JSON
    encoder's recursion. Neither raises; the config is not handed over."""
    deep: list[object] = []
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]
    for data in ({"processes": {"workers": float("nan")}}, {"processes": {"pools": deep}}):
        handed = json.loads(_handover({"A": "b"}, ConfigSource(data, "/", "c.yaml")))
        assert handed == {"secrets": {"A": "b"}}


def test_a_document_over_what_the_tree_reads_is_left_to_it_to_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("processes: {workers: 2}\n")
    handed = json.loads(_handover({"A": "b"}, read_config(path)))
    assert handed["config"]["data"] == {"processes": {"workers": 2}}
    monkeypatch.setattr("flowforge.tree.MAX_SECRETS_BYTES", len(json.dumps(handed)) - 1)
    assert json.loads(_handover({"A": "b"}, read_config(path))) == {"secrets": {"A": "b"}}


def memory_file(data: bytes) -> int:
    fd = os.memfd_create("test-secrets", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def test_the_tree_takes_the_secrets_and_closes_their_descriptor() -> None:
    fd = memory_file(json.dumps({"secrets": SECRET_ENV}).encode())
    env = {SECRETS_FD_ENV: str(fd), "PATH": "/bin"}
    assert _take_handover(env) == (SECRET_ENV, None)
    assert env == {"PATH": "/bin"}
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: no child inherits it
    assert _take_handover({"PATH": "/bin"}) == ({}, None)


@pytest.mark.parametrize(
    ("named", "message"),
    [
        ("x1", "is not a file descriptor"),
        ("987654", "cannot read descriptor 987654"),
        ("garbage", "does not hold the tree's config"),
        ("list", "does not hold the tree's config"),
        ("secrets not text", "does not hold the tree's config"),
        ("document not a mapping", "does not hold the tree's config"),
        ("no base directory", "does not hold the tree's config"),
    ],
)
def test_a_bad_secrets_descriptor_is_refused_in_one_line(named: str, message: str) -> None:
    held = {
        "garbage": b"\xff{",
        "list": b'["a"]',
        "secrets not text": b'{"secrets": {"A": 1}}',
        "document not a mapping": b'{"secrets": {}, "config": {"data": [], "base_dir": "/",'
        b' "where": "c"}}',
        "no base directory": b'{"secrets": {}, "config": {"data": {}, "where": "c"}}',
    }
    if named in held:
        named = str(memory_file(held[named]))
    with pytest.raises(ValueError, match=message) as info:
        _take_handover({SECRETS_FD_ENV: named})
    assert "\n" not in str(info.value)


def test_the_tree_entry_refuses_a_bad_secrets_descriptor_with_one_line_and_2() -> None:
    env = {**os.environ, SECRETS_FD_ENV: "987654"}
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.tree", "x.yaml", ""],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == exitcodes.USAGE
    assert (
        done.stderr
        == f"flowforge: {SECRETS_FD_ENV}: cannot read descriptor 987654: Bad file descriptor\n"
    )
