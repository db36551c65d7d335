"""What every peer module shares: its command line, its worker subprocesses, waiting with a
deadline, the broker's queues, and the one JSON line it prints.

Runs in the comparison's own virtual environment (``.venv-compare``, made by ``driver``), where
FlowForge is not installed: it imports only the standard library and pika (which Dramatiq's
``rabbitmq`` extra installs there), never ``flowforge`` nor the rest of ``tests.harness``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pika

#: How often a peer looks at its store for "all done": the most a figure can be late by.
POLL_S = 0.01
#: How long a peer's workers get to come up, and to stop on SIGTERM before SIGKILL.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
#: Runs created per statement / per publishing loop turn, as FlowForge's bench triggers them.
BATCH = 500


#: What the driver sets in a peer's environment (its workers inherit it): the run's scratch
#: database (a libpq conninfo), the broker, and the run's queue name (deleted after).
ENV = ("CMP_DATABASE_URL", "CMP_BROKER_URL", "CMP_QUEUE")


def parser(prog: str) -> argparse.ArgumentParser:
    """The sizes every peer module takes; the driver builds them (``driver.peer_command``)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--workers", type=int, required=True, help="worker processes")
    p.add_argument("--tasks", type=int, required=True)
    p.add_argument("--chain", type=int, required=True)
    p.add_argument("--fanout", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds per workload")
    p.add_argument("--log", type=Path, required=True, help="the workers' output goes here")
    return p


def service(name: str) -> str:
    """One of :data:`ENV`; the module-level setup of each peer reads them at import, in the
    bench and in its workers alike."""
    return os.environ.get(name, "")


class Workers:
    """Worker processes started as real subprocesses from the checkout (they inherit the
    environment, :data:`ENV` with it), each in a session of its own; on exit each is sent
    SIGTERM (the tools' warm shutdown), and a group still alive after :data:`STOP_TIMEOUT_S` is
    killed (only the groups this object started)."""

    def __init__(self, commands: Sequence[Sequence[str]], log: Path) -> None:
        self.commands = [list(c) for c in commands]
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Workers:
        with self.log.open("ab") as out:
            for command in self.commands:
                self.procs.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=out,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        return self

    def check(self) -> bool:
        """True while every worker lives; raises with the log's tail when one has exited."""
        for proc in self.procs:
            if proc.poll() is not None:
                tail = " | ".join(self.log.read_text(errors="replace").splitlines()[-5:])
                raise RuntimeError(f"a worker exited with {proc.returncode}: {tail}")
        return True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # the process leads the group it was started in: its own children go with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``done`` every :data:`POLL_S` until it is true; return ``time.perf_counter()`` then.
    Raises ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return time.perf_counter()
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")


class Broker:
    """One AMQP connection to look at queues with (the peers' own clients do the work)."""

    def __init__(self, url: str) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.conn.channel()

    def counts(self, queue: str) -> tuple[int, int]:
        """(ready messages, consumers) of ``queue``; (0, 0) when it does not exist yet. Unacked
        deliveries are not counted: AMQP's declare-ok does not carry them."""
        try:
            ok = self.channel.queue_declare(queue, passive=True).method
        except pika.exceptions.ChannelClosedByBroker:  # 404: not declared yet
            self.channel = self.conn.channel()
            return 0, 0
        return int(ok.message_count), int(ok.consumer_count)

    def exists(self, queue: str) -> bool:
        try:
            self.channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:  # 404
            self.channel = self.conn.channel()
            return False
        return True

    def declare_marker(self, queue: str) -> None:
        """A durable queue no worker consumes: the last step of a chain or the join of a
        fan-out is routed there, and its arrival is the workload's end."""
        self.channel.queue_declare(queue, durable=True)

    def wait_marker(self, queue: str, timeout_s: float) -> float:
        """Block until a message reaches ``queue`` (taken and acked); ``perf_counter()`` then."""
        for method, _props, _body in self.channel.consume(queue, inactivity_timeout=timeout_s):
            if method is None:
                break
            self.channel.basic_ack(method.delivery_tag)
            self.channel.cancel()
            return time.perf_counter()
        raise RuntimeError(f"timed out after {timeout_s}s waiting for a message on {queue}")

    def delete(self, queues: Sequence[str] = (), exchanges: Sequence[str] = ()) -> None:
        """Delete what a run declared; a name that is not there is skipped."""
        for delete, name in [(self._queue, q) for q in queues] + [
            (self._exchange, e) for e in exchanges
        ]:
            self.channel = self.conn.channel()
            with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                delete(name)

    def _queue(self, name: str) -> None:
        self.channel.queue_delete(name)

    def _exchange(self, name: str) -> None:
        self.channel.exchange_delete(name)

    def close(self) -> None:
        self.conn.close()


def rate(tasks: int, started: float, ended: float) -> dict[str, float]:
    """A workload's figure: its wall time and ``tasks`` per second over it."""
    wall = ended - started
    return {"wall_s": round(wall, 4), "tasks_per_s": round(tasks / wall, 1)}


def per_hop(length: int, started: float, ended: float) -> dict[str, float]:
    """A chain's figure: its wall time and the mean time per step (first dispatch included)."""
    wall = ended - started
    return {"wall_s": round(wall, 4), "ms_per_hop": round(1000 * wall / length, 3)}


def emit(report: dict[str, Any]) -> None:
    """The peer's result: one JSON object, the last line of its stdout (the driver reads it)."""
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
