"""The sd_notify client (supervisor/notify.py) against real AF_UNIX datagram sockets.

A bound ``SOCK_DGRAM`` socket stands in for systemd's notify socket: what the client sends is
read back byte for byte, at a path and in the abstract namespace. The environment rules
(``WATCHDOG_USEC`` / ``WATCHDOG_PID``, the variables taken out for children) are checked on plain
mappings.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import notify
from supervisor.notify import Notifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A notify socket at a path; (the socket, its address)."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5.0)
        yield sock, str(path)


def test_fields_arrive_as_one_datagram_of_lines(listener: tuple[socket.socket, str]) -> None:
    sock, address = listener
    assert Notifier(address).send(["READY=1", "STATUS=ready: worker 2/2"])
    assert sock.recv(4096) == b"READY=1\nSTATUS=ready: worker 2/2\n"


def test_an_at_sign_names_the_abstract_namespace() -> None:
    name = f"flowforge-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5.0)
        assert Notifier("@" + name).send(["WATCHDOG=1"])
        assert sock.recv(4096) == b"WATCHDOG=1\n"


def test_without_notify_socket_nothing_is_sent_or_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_socket(*_args: object) -> socket.socket:
        raise AssertionError("no socket may be opened without NOTIFY_SOCKET")

    monkeypatch.setattr(notify.socket, "socket", no_socket)
    notifier = Notifier.from_environment({"WATCHDOG_USEC": "2000000"}, pid=42)
    assert not notifier.enabled
    assert notifier.send(["READY=1"]) is False
    assert notifier.watchdog_interval_s() is None  # a watchdog with nobody to tell is none


def test_the_variables_leave_the_environment_so_children_cannot_inherit_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in [
        ("NOTIFY_SOCKET", "/run/systemd/notify"),
        ("WATCHDOG_USEC", "30000000"),
        ("WATCHDOG_PID", str(os.getpid())),
        ("FLOWFORGE_CONFIG", "/etc/flowforge/config.yaml"),
    ]:
        monkeypatch.setenv(name, value)
    notifier = Notifier.from_environment()
    assert notifier.address == "/run/systemd/notify"
    assert notifier.watchdog_interval_s() == 15.0
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & os.environ.keys()
    assert os.environ["FLOWFORGE_CONFIG"] == "/etc/flowforge/config.yaml"  # the rest stays


@pytest.mark.parametrize(
    ("usec", "watched_pid", "interval"),
    [
        ("30000000", None, 15.0),  # no WATCHDOG_PID: meant for whoever reads it
        ("30000000", "4242", 15.0),  # our pid
        ("30000000", "4243", None),  # another process's watchdog
        ("1000000", "4242", 0.5),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("²", None, None),  # a digit to str.isdigit, not to int()
        (None, "4242", None),
    ],
)
def test_the_watchdog_is_half_of_watchdog_usec_and_only_for_the_pid_it_names(
    usec: str | None, watched_pid: str | None, interval: float | None
) -> None:
    env = {"NOTIFY_SOCKET": "@manager"}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if watched_pid is not None:
        env["WATCHDOG_PID"] = watched_pid
    assert Notifier.from_environment(env, pid=4242).watchdog_interval_s() == interval
    assert env == {}


def test_an_address_of_another_kind_is_refused_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="supervisor.notify")
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "vsock:2:1234"}, pid=1)
    assert not notifier.enabled and notifier.send(["READY=1"]) is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "vsock:2:1234" in record.getMessage()


def test_a_failed_send_returns_false_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="supervisor.notify")
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert [notifier.send(["WATCHDOG=1"]) for _ in range(3)] == [False, False, False]
    levels = [r.levelno for r in caplog.records if getattr(r, "action", "") == "notify_failed"]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "nobody-listens.sock" in caplog.records[0].getMessage()


def test_a_manager_that_does_not_read_never_blocks_the_sender(
    listener: tuple[socket.socket, str],
) -> None:
    _sock, address = listener  # bound, never read: its queue fills
    notifier = Notifier(address)
    sent = 0
    while notifier.send(["WATCHDOG=1"]):
        sent += 1
        assert sent < 100_000, "the queue never filled"
    assert sent >= 1  # the first ones were queued; the one that found no room gave up


def test_a_status_is_sent_as_given_and_an_empty_message_not_at_all(
    listener: tuple[socket.socket, str],
) -> None:
    sock, address = listener
    notifier = Notifier(address)
    assert notifier.send([]) is False
    assert notifier.send(["STATUS=ready: ünïcode 1/1"])
    assert sock.recv(4096) == "STATUS=ready: ünïcode 1/1\n".encode()
