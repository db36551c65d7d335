"""Helpers for tests of group commit (flowforge/coalesce.py): calls released together, the
commits a client runs counted, a database nobody listens on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from flowforge import Client
from flowforge.config import Config, DatabaseConfig
from flowforge.domain.model import TriggerResult
from flowforge.domain.plan import RunRequest
from tests.harness.resources import free_ports

#: Upper bound on a barrier's wait and on each call's answer (seconds).
WAIT_S = 30.0


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Every call from its own thread, released together; each one's result or exception."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        start.wait(WAIT_S)
        try:
            return call()
        except Exception as exc:  # what the caller's own thread raised
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(WAIT_S) for f in [pool.submit(run, c) for c in calls]]


@dataclass
class Commits:
    """What a client committed: the workflow of each call committed alone, and the size of
    each shared commit (its ``trigger_batch`` calls)."""

    alone: list[str] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)


def count_commits(client: Client, monkeypatch: pytest.MonkeyPatch) -> Commits:
    """Count ``client``'s commits from now until the test ends (its store's ``trigger`` for a
    lone call, its ``trigger_batch`` for a shared one; both still run)."""
    commits = Commits()
    alone, shared = client._store.trigger, client.trigger_batch

    def counted_alone(*args: Any, **kwargs: Any) -> TriggerResult:
        commits.alone.append(args[0].name)
        return alone(*args, **kwargs)

    def counted_shared(
        requests: Sequence[RunRequest], *, with_run: bool = False
    ) -> list[TriggerResult]:
        commits.shared.append(len(requests))
        return shared(requests, with_run=with_run)

    monkeypatch.setattr(client._store, "trigger", counted_alone)
    monkeypatch.setattr(client, "trigger_batch", counted_shared)
    return commits


def unreachable() -> Config:
    """A config whose database nobody listens on (a free port: refused at once)."""
    [port] = free_ports(1)
    url = f"postgresql://postgres@127.0.0.1:{port}/nowhere"
    return Config(database=DatabaseConfig(url=url, connect_timeout_s=1))
