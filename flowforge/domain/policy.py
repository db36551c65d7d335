"""Retry policy and the decision taken after a failed attempt.

Pure: randomness is injected (``rand`` returns a float in [0, 1)), and delays are returned in
seconds for the store to add to the *database* clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from flowforge.domain.reasons import RETRYABLE_REASONS, FailureReason

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_BASE_DELAY_S = 1.0
DEFAULT_MAX_DELAY_S = 300.0
DEFAULT_CRASH_LOOP_THRESHOLD = 3
#: Longest backoff accepted (one year): keeps retry times far inside PostgreSQL's range.
MAX_DELAY_LIMIT_S = 365 * 24 * 3600.0
# 2**62 seconds is far beyond any cap; clamping the exponent keeps the float finite.
_MAX_EXPONENT = 62


class Jitter(StrEnum):
    """How a backoff ceiling is turned into a delay."""

    FULL = "full"  # uniform in [0, ceiling)
    EQUAL = "equal"  # ceiling/2 + uniform in [0, ceiling/2)
    NONE = "none"  # exactly the ceiling


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with a cap and jitter; ``max_attempts`` counts the first one too."""

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    base_delay: float = DEFAULT_BASE_DELAY_S
    max_delay: float = DEFAULT_MAX_DELAY_S
    jitter: Jitter = Jitter.FULL

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not (
            0 <= self.base_delay <= MAX_DELAY_LIMIT_S and 0 <= self.max_delay <= MAX_DELAY_LIMIT_S
        ):
            raise ValueError(
                f"delays must be finite, between 0 and {MAX_DELAY_LIMIT_S:.0f} seconds"
            )
        if self.max_delay < self.base_delay:
            raise ValueError("max_delay must not be smaller than base_delay")

    def ceiling(self, failed_attempts: int) -> float:
        """Backoff ceiling in seconds after ``failed_attempts`` (>= 1) failures."""
        exponent = min(max(failed_attempts, 1) - 1, _MAX_EXPONENT)
        return float(min(self.max_delay, self.base_delay * 2.0**exponent))

    def delay(self, failed_attempts: int, rand: Callable[[], float]) -> float:
        """Seconds to wait before the next attempt, jitter applied."""
        ceiling = self.ceiling(failed_attempts)
        if self.jitter is Jitter.FULL:
            return ceiling * rand()
        if self.jitter is Jitter.EQUAL:
            return ceiling / 2 + (ceiling / 2) * rand()
        return ceiling


@dataclass(frozen=True)
class Retry:
    """Schedule another attempt after ``delay`` seconds."""

    delay: float


@dataclass(frozen=True)
class Bury:
    """Give up: the task goes DEAD with ``reason``."""

    reason: FailureReason


@dataclass(frozen=True)
class Cancel:
    """The run asked the task to stop: it ends CANCELLED instead of retrying."""


Decision = Retry | Bury | Cancel


@dataclass(frozen=True)
class FailureFacts:
    """What is known about a task run when its attempt has failed."""

    reason: FailureReason
    attempts_used: int  # attempts consumed since the task was created or last requeued
    crash_streak: int  # consecutive attempts that ended with an expired lease
    cancel_requested: bool = False
    bury_requested: bool = False  # an operator buried it while it ran (``flowforge task bury``)


def decide(
    policy: RetryPolicy,
    facts: FailureFacts,
    rand: Callable[[], float],
    crash_loop_threshold: int = DEFAULT_CRASH_LOOP_THRESHOLD,
) -> Decision:
    """Route a failed attempt: cancel, bury (DEAD) or retry with a backoff.

    A task an operator buried while it ran is buried with reason ``operator`` (whatever its
    attempt's outcome); one its run or an operator asked to stop is cancelled.

    A task whose lease expired on ``crash_loop_threshold`` attempts in a row is buried as a
    crash loop (a poison task that kills its worker must not kill worker after worker).
    """
    if facts.bury_requested:  # the stop an operator's bury asked for: DEAD, not CANCELLED
        return Bury(FailureReason.OPERATOR)
    if facts.cancel_requested:
        return Cancel()
    if facts.reason is FailureReason.LEASE_EXPIRED and facts.crash_streak >= crash_loop_threshold:
        return Bury(FailureReason.CRASH_LOOP)
    if facts.reason not in RETRYABLE_REASONS:
        return Bury(facts.reason)
    if facts.attempts_used >= policy.max_attempts:
        return Bury(FailureReason.MAX_ATTEMPTS_EXCEEDED)
    return Retry(policy.delay(facts.attempts_used, rand))
