"""Running real role processes (`flowforge role NAME`) for end-to-end and chaos tests.

A :class:`Stack` writes a config into a temporary folder (its own queue name, short leases and
poll intervals), starts role processes as subprocesses with their logs in files, and stops
whatever it started — by pid, with a deadline — at the end of the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import yaml

from flowforge.domain.names import BANDS, band_queue
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
HANDLERS_MODULE = "tests.e2e_handlers"
#: The variable through which those handlers find the database they record executions in.
RECORD_URL_ENV = "FLOWFORGE_E2E_RECORD_URL"
STOP_TIMEOUT_S = 15.0

DEFAULT_SETTINGS: dict[str, Any] = {
    "worker": {"lease_s": 3.0, "heartbeat_s": 0.5, "key_wait_s": 0.2},
    "scheduler": {"poll_interval_s": 0.2, "batch_size": 200},
    "broker": {"heartbeat_s": 10},
}


class RoleProcess:
    """One `flowforge role NAME` subprocess with its output in a log file."""

    def __init__(self, role: str, config: Path, env: Mapping[str, str], log: Path) -> None:
        self.role = role
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "role", role],
            cwd=REPO,
            env=dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        wait_for(lambda: text in self.log(), timeout=timeout, what=f"{self.role} to log {text!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode


@dataclass
class Stack:
    """A config for one test and the role processes started from it."""

    directory: Path
    database_url: str
    broker_url: str
    queue: str = field(default_factory=lambda: f"flowforge.test.{uuid.uuid4().hex[:10]}")
    processes: list[RoleProcess] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. the api token

    def config_path(self, **overrides: Any) -> Path:
        """Write the config (deep-merged ``overrides``) and return its path."""
        settings: dict[str, Any] = {
            "database": {"url": self.database_url},
            "broker": {"url": self.broker_url, "queue": self.queue},
            "handlers": [HANDLERS_MODULE],
            "workflows": [],
        }
        for source in (DEFAULT_SETTINGS, overrides):
            for key, value in source.items():
                if isinstance(value, dict):
                    settings[key] = {**settings.get(key, {}), **value}
                else:
                    settings[key] = value
        path = self.directory / f"config-{len(self.processes)}.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
        env["FLOWFORGE_DATABASE_URL"] = self.database_url
        env[RECORD_URL_ENV] = self.database_url  # e2e handlers record executions here
        env["PYTHONUNBUFFERED"] = "1"
        return {**env, **self.extra_env}

    def start(self, role: str, **overrides: Any) -> RoleProcess:
        config = self.config_path(**overrides)
        log = self.directory / f"{role}-{len(self.processes)}.log"
        process = RoleProcess(role, config, self.env(), log)
        self.processes.append(process)
        return process

    def start_all(self, workers: int = 1, **overrides: Any) -> list[RoleProcess]:
        started = [self.start("scheduler", **overrides), self.start("publisher", **overrides)]
        started += [self.start("worker", **overrides) for _ in range(workers)]
        return started

    def stop_all(self) -> None:
        for process in self.processes:
            process.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            try:
                process.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.signal(signal.SIGKILL)
            process.stop()

    def delete_queue(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        except pika.exceptions.AMQPError:
            return
        try:
            channel = conn.channel()
            for index in range(len(BANDS)):  # the queue and its priority bands
                channel.queue_delete(band_queue(self.queue, index))
        finally:
            conn.close()
