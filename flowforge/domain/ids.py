"""Ids of new runs and task runs: time-ordered UUIDs (version 7, RFC 9562 section 5.7).

A random id (version 4) lands on a random leaf page of every index keyed by it — the primary
keys of workflow_runs and task_runs, task_edges', task_attempts' and the outbox's keys on a task
— so once those indexes outgrow the server's buffer cache, each insert reads and dirties a page
nobody touched lately (docs/performance.md, "Time-ordered ids"). A version-7 id begins with the
Unix time in milliseconds: the rows a tree inserts now sit together at the right edge of each
index, as a sequence's would, while any process still makes ids alone, with no round trip and
no coordination between trees (74 random bits a millisecond).

Python's ``uuid`` module has ``uuid7`` from 3.14; until FlowForge requires it, these few lines
stand in (a native package for them would be one more wheel to build on every platform).
"""

from __future__ import annotations

import os
import time
from uuid import UUID

_VERSION = 0x7 << 76  # bits 48-51 of the 128 (RFC 9562 section 4.2)
_VARIANT = 0x2 << 62  # bits 64-65: the RFC's variant
_KEEP = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)


def new_id(now_ns: int | None = None) -> UUID:
    """A new version-7 UUID: 48 bits of Unix time in milliseconds (``now_ns``, nanoseconds,
    defaults to the wall clock), then 74 random bits around the version and variant. Ids made
    in later milliseconds sort after earlier ones; within one millisecond their order is
    random."""
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | int.from_bytes(os.urandom(10), "big")
    return UUID(int=value & _KEEP | _VERSION | _VARIANT)
