"""A child process that stops when the process that started it dies (Linux's parent-death signal).

``flowforge dev``, the pytest fixture's tree and the benchmark and chaos harness each start
``flowforge up`` as a child; killed (a CI timeout, Ctrl-C on a wrapper), they must not leave the
tree running with nobody to stop it. :func:`stop_with_parent` runs in the forked child before
its exec: the setting survives the exec, and the tree's own children have theirs
(docs/failure-model.md, mode 19).
"""

from __future__ import annotations

import ctypes
import os
import signal

#: prctl(2)'s option for the signal a process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def stop_with_parent(parent: int | None = None) -> None:
    """In a forked child, before its exec: SIGTERM it (a drain) when its parent dies. Given
    ``parent`` (the pid that forked it), a parent already gone by now is caught too. Not on
    Linux: nothing (the child outlives a killed parent, as without it)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
