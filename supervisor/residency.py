"""Giving back the pages of files a process mapped read-only and only read at start-up.

A process that imports a library which initialises OpenSSL or libpq keeps resident every page
of those libraries its start-up touched, most of it code it never runs again. Such a page is a
clean copy of the file — a private mapping never written holds no anonymous page — so
``madvise(MADV_DONTNEED)`` may unmap it: a page touched again later is mapped back from the
page cache by a minor fault, with the file's contents. The pages leave the process's RSS and
PSS; they stay in the page cache (reclaimable at no cost) while nothing maps them, so the
machine's memory gains only once the kernel needs it (docs/performance.md, "The tree under
250 MB again").

The supervisor does this each time its tree is ready: it forks its children from a process
that imported their libraries, and a child does not inherit the parent's mapped file pages
(fork copies no page table entry of an unwritten file mapping), so they are the supervisor's
alone. Call it only while no other thread of the process can be loading a library: a mapping
that gains a written page between the read of ``smaps`` and the ``madvise`` would lose it.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: ``<sys/mman.h>``: drop the range's pages; a private file mapping refaults from the file.
MADV_DONTNEED = 4
#: ``start-end perms offset dev inode path``: one mapping's header line in ``smaps``.
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")

#: ``madvise(address, length, advice)``: 0 on success.
Advise = Callable[[int, int, int], int]


@dataclass
class Region:
    """One mapping of ``/proc/<pid>/smaps``: its range, permissions, path and resident kB."""

    start: int
    end: int
    perms: str
    path: str
    rss_kb: int = 0
    anonymous_kb: int = 0

    @property
    def droppable(self) -> bool:
        """A file's private, read-only mapping with resident pages and none written (a
        relocated one holds written pages, which the file's contents would replace)."""
        return (
            self.path.startswith("/")
            and not self.path.endswith(" (deleted)")
            and not self.path.startswith("/memfd:")
            and self.perms[1] != "w"
            and self.perms[3] == "p"
            and self.rss_kb > 0
            and self.anonymous_kb == 0
        )


def mappings(smaps: str) -> Iterator[Region]:
    """The mappings described by the text of an ``smaps`` file, in its order."""
    current: Region | None = None
    for line in smaps.splitlines():
        header = _HEADER.match(line)
        if header:
            if current is not None:
                yield current
            start, end, perms, path = header.groups()
            current = Region(int(start, 16), int(end, 16), perms, path)
        elif current is not None and line.startswith("Rss:"):
            current.rss_kb = int(line.split()[1])
        elif current is not None and line.startswith("Anonymous:"):
            current.anonymous_kb = int(line.split()[1])
    if current is not None:
        yield current


def drop_file_pages(smaps_path: str = "/proc/self/smaps", advise: Advise | None = None) -> int:
    """Unmap the resident pages of this process's droppable mappings (:attr:`Region.droppable`);
    the kB that were resident in those whose ``madvise`` succeeded. 0 where ``smaps`` or
    ``madvise`` is not there (not Linux): nothing is dropped."""
    try:
        with open(smaps_path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return 0
    if advise is None:
        advise = _libc_madvise()
        if advise is None:
            return 0
    dropped = 0
    for mapping in mappings(text):
        if (
            mapping.droppable
            and advise(mapping.start, mapping.end - mapping.start, MADV_DONTNEED) == 0
        ):
            dropped += mapping.rss_kb
    return dropped


def _libc_madvise() -> Advise | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
