"""Per-child liveness and readiness in anonymous shared memory, created before any fork.

The parent assigns a slot to each child it starts; the child writes its slot (a beat is the
monotonic clock, which is system-wide, so parent and child compare the same clock) and the
parent, or any child that wants to know whether the tree is ready, reads the table.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable, Iterable

FREE = -1


class SlotTable:
    """``capacity`` slots of (spec index, pid, last beat, ready).

    ``clock`` gives the beats' times (seconds): the system-wide monotonic clock, or the fake
    clock of a test whose "children" beat in its own process.
    """

    def __init__(
        self, capacity: int, spec_count: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self._clock = clock
        # One anonymous MAP_SHARED mapping (zeroed), so forked children write the parent's
        # copy. Plain mmap rather than multiprocessing's shared arrays: the multiprocessing
        # package would be imported here and inherited by every child (~0.9 MiB of RSS each).
        # The doubles come first so that every array stays aligned.
        double, int_ = ctypes.sizeof(ctypes.c_double), ctypes.sizeof(ctypes.c_int)
        size = double * capacity + int_ * (2 * capacity + spec_count) + capacity
        self._memory = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        at = 0
        self._beat = (ctypes.c_double * capacity).from_buffer(self._memory, at)
        at += double * capacity
        self._spec = (ctypes.c_int * capacity).from_buffer(self._memory, at)
        at += int_ * capacity
        self._pid = (ctypes.c_int * capacity).from_buffer(self._memory, at)
        at += int_ * capacity
        self._desired = (ctypes.c_int * spec_count).from_buffer(self._memory, at)
        at += int_ * spec_count
        self._ready = (ctypes.c_ubyte * capacity).from_buffer(self._memory, at)
        for slot in range(capacity):
            self._spec[slot] = FREE

    # ------------------------------------------------------------------ parent side

    def allocate(self, spec_index: int) -> int:
        for slot in range(self.capacity):
            if self._spec[slot] == FREE:
                self._spec[slot] = spec_index
                self._pid[slot] = 0
                self._ready[slot] = 0
                self._beat[slot] = self._clock()
                return slot
        raise RuntimeError("no free child slot: raise the supervisor's capacity")

    def assign_pid(self, slot: int, pid: int) -> None:
        self._pid[slot] = pid

    def release(self, slot: int) -> None:
        self._spec[slot] = FREE
        self._pid[slot] = 0
        self._ready[slot] = 0

    def set_desired(self, spec_index: int, count: int) -> None:
        self._desired[spec_index] = count

    # ------------------------------------------------------------------ child side

    def beat(self, slot: int) -> None:
        self._beat[slot] = self._clock()

    def mark_ready(self, slot: int) -> None:
        self._beat[slot] = self._clock()
        self._ready[slot] = 1

    # ------------------------------------------------------------------ readers

    def silent_for(self, slot: int, now: float) -> float:
        return now - self._beat[slot]

    def is_ready(self, slot: int) -> bool:
        return bool(self._ready[slot])

    def readiness(self, spec_indexes: Iterable[int]) -> dict[int, tuple[int, int]]:
        """For each spec index: (children ready, children desired)."""
        wanted = set(spec_indexes)
        ready = dict.fromkeys(wanted, 0)
        for slot in range(self.capacity):
            spec = self._spec[slot]
            if spec in wanted and self._ready[slot]:
                ready[spec] += 1
        return {i: (ready[i], self._desired[i]) for i in wanted}
