"""Starting one child: fork, then prepare the child before its target runs.

The child's constructor work happens in the parent (the spec and the slot are plain data);
everything that opens resources happens in the target, after the fork. Right after the fork the
child restores default signal handling, asks the kernel to SIGKILL it if the parent dies
(``PR_SET_PDEATHSIG``), and checks that the parent did not die already — so no child outlives a
killed supervisor by more than a moment.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from supervisor.slots import SlotTable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class ChildContext:
    """What a child knows about itself; ``beat`` and ``ready`` write its shared slot."""

    name: str
    instance: int  # 1-based within its spec
    count: int  # the spec's desired count when this child started
    slot: int
    table: SlotTable
    spec_names: tuple[str, ...]

    def beat(self) -> None:
        """Report liveness; call at least every ``liveness_timeout_s``."""
        self.table.beat(self.slot)

    def ready(self) -> None:
        """Report that this child finished booting and serves, and give the heap its boot
        freed back to the system."""
        self.table.mark_ready(self.slot)
        release_free_memory()

    def tree_readiness(self) -> dict[str, tuple[int, int]]:
        """For every spec of the tree: (children ready, children desired)."""
        found = self.table.readiness(range(len(self.spec_names)))
        return {self.spec_names[i]: counts for i, counts in found.items()}


def _libc(symbol: str) -> Any | None:
    """A C library function as linked into this interpreter (``dlopen(NULL)``: no library
    search, which would run ``ldconfig`` in a subprocess); None where the C library lacks it."""
    return getattr(ctypes.CDLL(None, use_errno=True), symbol, None)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op where
    the C library has none). Start-up frees much (import machinery, parsed files) that stays
    resident otherwise — and a page resident in the parent at fork is counted in every child."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


#: glibc's ``mallopt`` parameter for the size from which a block gets its own mapping.
M_MMAP_THRESHOLD = -3
#: That size, fixed at glibc's own starting value (bytes).
MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> None:
    """Keep every block of ``MMAP_THRESHOLD`` or more in a mapping of its own, returned to the
    system when freed (a no-op where the C library has no ``mallopt``).

    glibc raises that threshold each time such a block is freed (up to 32 MiB), and with it the
    heap's trim threshold; from then on large blocks — a fan-in's upstream results, a map's
    items, a big batch of rows — are carved from the heap, and their pages stay resident after
    they are freed. Fixing the threshold turns that off. Called before the first fork, it holds
    in every child: 2.9 MiB less for a tree of four workers after the bench's workloads
    (docs/performance.md, "Memory")."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def set_child_subreaper() -> None:
    """Orphaned grandchildren get reparented to this process (so it can reap them)."""
    prctl = _libc("prctl")
    if prctl is not None:
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def spawn(
    target: Callable[[ChildContext], int],
    ctx: ChildContext,
    handled_signals: Iterable[int],
    close_fds: Iterable[int],
) -> int:
    """Fork a child that runs ``target(ctx)`` and exits with its return value; return its pid."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _prepare_child(parent, handled_signals, close_fds)
        code = int(target(ctx) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        try:
            logger.exception("child %s-%d crashed", ctx.name, ctx.instance)
        except Exception:  # logging itself is broken: a raw line is better than nothing
            with contextlib.suppress(Exception):
                os.write(2, f"child {ctx.name} crashed: {traceback.format_exc(limit=3)}".encode())
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _prepare_child(parent: int, handled_signals: Iterable[int], close_fds: Iterable[int]) -> None:
    signal.set_wakeup_fd(-1)
    for signum in handled_signals:
        signal.signal(signum, signal.SIG_DFL)
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    # Terminal signals (Ctrl-C) go to the supervisor only, which stops children in order.
    os.setpgid(0, 0)
    prctl = _libc("prctl")
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)
