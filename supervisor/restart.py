"""Restart policy: per-slot exponential backoff and an OTP-style restart intensity limit.

Both take the monotonic time as an argument (``now``), so tests drive them without sleeping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SlotBackoff:
    """Delay before restarting one slot: ``base_s`` doubling to ``cap_s``.

    A child that stayed up (and ready) for ``healthy_after_s`` resets the slot's count.
    """

    base_s: float = 0.5
    cap_s: float = 30.0
    healthy_after_s: float = 10.0
    failures: int = 0

    def next_delay(self, uptime_s: float) -> float:
        """The delay before the next start, after a child that ran for ``uptime_s`` died."""
        if uptime_s >= self.healthy_after_s:
            self.failures = 0
        delay = min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 30))
        self.failures += 1
        return delay


@dataclass
class IntensityLimit:
    """More than ``max_restarts`` restarts within ``period_s`` seconds trips the limit."""

    max_restarts: int = 10
    period_s: float = 60.0
    _times: deque[float] = field(default_factory=deque)

    def record(self, now: float) -> bool:
        """Count a restart at ``now``; True if the limit is now exceeded."""
        self._times.append(now)
        while self._times and self._times[0] <= now - self.period_s:
            self._times.popleft()
        return len(self._times) > self.max_restarts
