"""Noticing that source files changed: what ``flowforge dev`` reloads the workers on.

Polling, not inotify: a stat of each watched file every interval needs no dependency and no
kernel watch per directory (inotify's per-user limit is often 8,192, and a project with a
virtualenv inside it exceeds it), works the same on bind mounts, network filesystems and
container volumes (where inotify sees nothing of changes made on the host), and sees an editor's
save by rename (a new inode) like any other. What it costs is latency — up to one interval,
half a second by default — and one ``stat`` per file per interval, which for the few hundred
files of a project is nothing. The walk is bounded (:data:`MAX_FILES`).

A save is often several writes (a truncate, the content, a rename, a formatter rewriting the
file a moment later): :class:`Watcher` reports a change once the files have been quiet for
``quiet_s``, or at the latest ``max_wait_s`` after the first change, so one save is one reload.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: What tells two versions of a file apart: (mtime in ns, size in bytes, inode).
Signature = tuple[int, int, int]
#: A scan: every watched file that exists, with its signature.
Snapshot = Mapping[Path, Signature]

#: Suffixes of the files a directory root watches.
SOURCE_SUFFIXES = (".py", ".yaml", ".yml")
#: Directories never entered: caches, version control, virtualenvs' usual names, dependencies.
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "venv", "site-packages"})
#: The most files one scan looks at; past it the rest are not watched (logged once).
MAX_FILES = 20_000


@dataclass(frozen=True)
class WatchSet:
    """What to watch: ``files`` themselves (a missing one is watched for its creation), and in
    each of ``dirs``, recursively, every file with one of ``suffixes`` — except in hidden
    directories, :data:`SKIPPED_DIRS`, a virtualenv (a folder holding ``pyvenv.cfg``) and
    ``excluded`` (e.g. ``flowforge dev``'s own state directory)."""

    files: tuple[Path, ...] = ()
    dirs: tuple[Path, ...] = ()
    suffixes: tuple[str, ...] = SOURCE_SUFFIXES
    excluded: tuple[Path, ...] = ()


def _signature(path: Path) -> Signature | None:
    try:
        info = path.stat()
    except OSError:  # gone (or never there), or not readable: not a file to compare
        return None
    return (info.st_mtime_ns, info.st_size, info.st_ino)


def _walk(root: Path, watch: WatchSet) -> Iterable[Path]:
    excluded = {str(p) for p in watch.excluded}
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(
            d
            for d in subdirs
            if not d.startswith(".")
            and d not in SKIPPED_DIRS
            and os.path.join(folder, d) not in excluded
            and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))
        )
        for name in sorted(names):
            if name.endswith(watch.suffixes):
                yield Path(folder, name)


def scan(watch: WatchSet, limit: int = MAX_FILES) -> dict[Path, Signature]:
    """Every file of ``watch`` that exists now, with its signature; at most ``limit`` files."""
    found: dict[Path, Signature] = {}
    candidates = [*watch.files, *(p for root in watch.dirs for p in _walk(root, watch))]
    for path in candidates:
        if len(found) >= limit:
            logger.warning("watching only the first %d files", limit)
            break
        signature = _signature(path)
        if signature is not None:
            found[path] = signature
    return found


def changed(before: Snapshot, after: Snapshot) -> set[Path]:
    """The files created, removed or modified between two snapshots."""
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


class Watcher:
    """Turns repeated scans into settled changes (module doc). Not thread-safe.

    ``scan`` returns the current snapshot, ``clock`` the monotonic time in seconds; the first
    scan is the baseline. Call :meth:`poll` every interval.
    """

    def __init__(
        self,
        scan: Callable[[], Snapshot],
        clock: Callable[[], float],
        *,
        quiet_s: float = 0.3,
        max_wait_s: float = 3.0,
    ) -> None:
        if quiet_s < 0 or max_wait_s < quiet_s:
            raise ValueError("need 0 <= quiet_s <= max_wait_s")
        self._scan = scan
        self._clock = clock
        self._quiet_s = quiet_s
        self._max_wait_s = max_wait_s
        self._last: Snapshot = scan()
        self._pending: set[Path] = set()
        self._first_at = 0.0
        self._latest_at = 0.0

    def poll(self) -> frozenset[Path]:
        """The files that changed since the last report, once they have settled; else empty."""
        now = self._clock()
        current = self._scan()
        new = changed(self._last, current)
        self._last = current
        if new:
            if not self._pending:
                self._first_at = now
            self._pending |= new
            self._latest_at = now
        if not self._pending:
            return frozenset()
        settled = now - self._latest_at >= self._quiet_s
        if not settled and now - self._first_at < self._max_wait_s:
            return frozenset()
        report, self._pending = frozenset(self._pending), set()
        return report
