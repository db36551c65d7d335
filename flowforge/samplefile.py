"""One process's metric samples in a memory-mapped file, in prometheus_client's multiprocess layout.

The api child reads the files of every process of the tree with
``prometheus_client.multiprocess.MultiProcessCollector``; the roles write theirs with this module
rather than with ``prometheus_client``, whose import (its exposition pulls http.server, email,
urllib and wsgiref) costs each of them about 2 MiB of resident memory (docs/performance.md,
"Memory").

Layout (as prometheus_client's ``mmap_dict`` reads it): an int32 giving the bytes in use, 4 bytes
of padding, then entries. An entry is an int32 key length, the UTF-8 key padded with spaces so
that what follows is 8-byte aligned, then two doubles: the value and a timestamp (always 0 here).
A reader trusts the bytes-in-use header, so an entry is written whole before the header grows to
include it. ``tests/unit/test_telemetry.py`` reads these files back with prometheus_client.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

#: Bytes a new file starts with (a few hundred samples); it doubles when full.
INITIAL_SIZE = 1 << 16
HEADER_SIZE = 8

_USED = struct.Struct("i")
_LENGTH = struct.Struct("i")
_VALUE = struct.Struct("dd")


def sample_key(metric: str, sample: str, labels: Mapping[str, str], documentation: str) -> str:
    """The key of one sample: metric name, sample name, labels and help, as JSON."""
    return json.dumps([metric, sample, dict(labels), documentation], sort_keys=True)


def _padding(length: int) -> int:
    """Spaces after a key of ``length`` bytes so its values are 8-byte aligned (1 to 8, never 0:
    prometheus_client's reader expects exactly this)."""
    return 8 - (length + _LENGTH.size) % 8


def _entry(key: str) -> bytes:
    encoded = key.encode("utf-8")
    padded = encoded + b" " * _padding(len(encoded))
    return _LENGTH.pack(len(encoded)) + padded + _VALUE.pack(0.0, 0.0)


class SampleFile:
    """Float samples by key, kept in one file that only this process writes.

    An existing file is continued, not truncated: a new process that got a dead one's pid adds
    to the dead process's counts instead of erasing them. Thread-safe.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size < INITIAL_SIZE:
            os.ftruncate(self._fd, INITIAL_SIZE)
            size = INITIAL_SIZE
        self._map = mmap.mmap(self._fd, size)
        self._used = _USED.unpack_from(self._map, 0)[0]
        self._positions: dict[str, int] = {}
        if self._used < HEADER_SIZE:
            self._used = HEADER_SIZE
            self._map[0 : _USED.size] = _USED.pack(self._used)
        else:
            self._positions = dict(self._scan())

    def add(self, key: str, amount: float) -> None:
        """Add ``amount`` to the sample ``key`` (created at 0 on first use)."""
        with self._lock:
            position = self._positions.get(key)
            if position is None:
                position = self._append(key)
            value = _VALUE.unpack_from(self._map, position)[0] + amount
            # One slice assignment, so a reader never sees a half-written double.
            self._map[position : position + _VALUE.size] = _VALUE.pack(value, 0.0)

    def value(self, key: str) -> float:
        """The sample's current value (0 for a key never written)."""
        with self._lock:
            position = self._positions.get(key)
            return 0.0 if position is None else float(_VALUE.unpack_from(self._map, position)[0])

    def close(self) -> None:
        with self._lock:
            self._map.close()
            os.close(self._fd)

    def _append(self, key: str) -> int:
        entry = _entry(key)
        end = self._used + len(entry)
        if end > len(self._map):
            self._grow(end)
        self._map[self._used : end] = entry
        self._used = end
        self._map[0 : _USED.size] = _USED.pack(self._used)
        position: int = end - _VALUE.size
        self._positions[key] = position
        return position

    def _grow(self, needed: int) -> None:
        size = len(self._map)
        while size < needed:
            size *= 2
        os.ftruncate(self._fd, size)
        self._map.close()
        self._map = mmap.mmap(self._fd, size)

    def _scan(self) -> list[tuple[str, int]]:
        found, position = [], HEADER_SIZE
        while position < self._used:
            length = _LENGTH.unpack_from(self._map, position)[0]
            start = position + _LENGTH.size
            key = bytes(self._map[start : start + length]).decode("utf-8")
            position = start + length + _padding(length)
            found.append((key, position))
            position += _VALUE.size
        return found
