"""What the supervisor runs: child specifications."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.child import ChildContext


class Restart(StrEnum):
    """When a child that exited is started again (OTP's restart types)."""

    PERMANENT = "permanent"  # always
    TRANSIENT = "transient"  # only after an abnormal exit (non-zero or a signal)
    TEMPORARY = "temporary"  # never


@dataclass(frozen=True)
class ChildSpec:
    """One kind of child.

    ``target(ctx)`` runs in the forked child and returns its exit code. ``stop_group``: on a
    graceful drain, lower groups are stopped (and awaited) first. ``liveness_timeout_s``: a
    child that has not called ``ctx.beat()`` for this long is considered hung (None: never).
    ``scalable`` children follow SIGTTIN/SIGTTOU; ``rolling`` ones are replaced on SIGHUP, one
    at a time, those of a lower ``roll_order`` first (then in the order they were started).
    """

    name: str
    target: Callable[[ChildContext], int]
    count: int = 1
    restart: Restart = Restart.PERMANENT
    shutdown_timeout_s: float = 10.0
    stop_group: int = 0
    liveness_timeout_s: float | None = None
    scalable: bool = False
    rolling: bool = False
    roll_order: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"{self.name}: count must not be negative")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"{self.name}: shutdown_timeout_s must be positive")
