"""Ports for private services: below the ephemeral range, never one that is taken or held by
another test process, and a start that finds one taken says which (``tests.harness``)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowforge.devservices.procs import ensure_ports_free
from tests.harness import CHECKOUT
from tests.harness.resources import PORT_FLOOR, choose_ports, free_ports
from tests.harness.services import (
    DEFAULT_PORTS,
    ServiceError,
    _CliConfig,
    _warn_if_ephemeral,
    ephemeral_range,
)

HOLDER_TIMEOUT_S = 30.0
#: Reserves the ports given on its command line, prints them, holds them until stdin closes.
HOLDER = """
import sys
from tests.harness.resources import choose_ports
print(*choose_ports(len(sys.argv) - 1, [int(p) for p in sys.argv[1:]]), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def listening() -> Iterator[int]:
    """A port below the ephemeral range that a listening socket holds (a server in the way)."""
    first, _ = ephemeral_range()
    for port in range(first - 1, PORT_FLOOR, -1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            sock.listen()
            yield port
            return
    pytest.fail("no port below the ephemeral range could be bound")


def test_the_dev_services_default_ports_are_below_the_ephemeral_range() -> None:
    first, _ = ephemeral_range()
    assert all(port < first for port in DEFAULT_PORTS)
    assert 25672 not in DEFAULT_PORTS  # the distribution port of the machine's own RabbitMQ


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    first, _ = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(PORT_FLOOR <= p < first and p not in DEFAULT_PORTS for p in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # raises if it were taken
    assert not set(ports) & set(free_ports(8)), "a port was handed out twice in one process"


def test_a_port_something_listens_on_is_skipped(listening: int) -> None:
    spare = _unreserved(1)
    assert choose_ports(1, [listening, *spare]) == spare


def test_a_port_another_test_process_holds_is_never_handed_out() -> None:
    candidates = _unreserved(3)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *map(str, candidates[:2])],
        cwd=CHECKOUT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        held = [int(p) for p in holder.stdout.readline().split()]
        assert held == candidates[:2]
        assert choose_ports(1, candidates) == [candidates[2]]
        with pytest.raises(RuntimeError, match="found only 0 of 1"):
            choose_ports(1, candidates[:2])
    finally:
        holder.communicate(timeout=HOLDER_TIMEOUT_S)  # closes its stdin: it exits


def test_a_start_that_finds_its_port_taken_names_the_service_and_the_port(listening: int) -> None:
    with pytest.raises(ServiceError, match=f"^AMQP port {listening} on 127.0.0.1 is already"):
        ensure_ports_free({"PostgreSQL": free_ports(1)[0], "AMQP": listening})


def _unreserved(count: int) -> list[int]:
    """``count`` bindable ports below the ephemeral range that no process has reserved, not
    reserved by this one either (probed from a child process that exits at once)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.harness.resources import free_ports as f; print(*f({count}))",
        ],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=HOLDER_TIMEOUT_S,
        check=True,
    )
    return [int(p) for p in probe.stdout.split()]


def test_services_start_warns_of_recorded_ports_in_the_ephemeral_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, last = ephemeral_range()
    old = _CliConfig(tmp_path, pg_port=first, amqp_port=last, dist_port=last - 1)
    _warn_if_ephemeral(old)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" port ")[1].split()[0] for line in lines] == [str(first), str(last)]
    assert all(str(tmp_path / "services.json") in line for line in lines)
    _warn_if_ephemeral(_CliConfig(tmp_path, *sorted(DEFAULT_PORTS)[:3]))
    assert capsys.readouterr().err == ""
