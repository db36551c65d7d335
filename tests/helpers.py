"""Small helpers shared by tests: polling with a deadline, ready-made workflows."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy

T = TypeVar("T")

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)


def wait_for(
    probe: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def single(name: str = "single", handler: str = "tests.noop", **task: object) -> WorkflowDef:
    """A one-task workflow."""
    return WorkflowDef(name, (TaskDef("only", handler, **task),))  # type: ignore[arg-type]


def chain(name: str = "chain", length: int = 3, retry: RetryPolicy = FAST_RETRY) -> WorkflowDef:
    """t0 → t1 → … → t(n-1)."""
    tasks = [
        TaskDef(f"t{i}", "tests.noop", depends_on=(f"t{i - 1}",) if i else (), retry=retry)
        for i in range(length)
    ]
    return WorkflowDef(name, tuple(tasks))


def diamond(name: str = "diamond", retry: RetryPolicy = FAST_RETRY, fail_fast: bool = True) -> WorkflowDef:
    """a → (b, c) → d."""
    return WorkflowDef(
        name,
        (
            TaskDef("a", "tests.noop", retry=retry),
            TaskDef("b", "tests.noop", depends_on=("a",), retry=retry),
            TaskDef("c", "tests.noop", depends_on=("a",), retry=retry),
            TaskDef("d", "tests.noop", depends_on=("b", "c"), retry=retry),
        ),
        fail_fast=fail_fast,
    )
