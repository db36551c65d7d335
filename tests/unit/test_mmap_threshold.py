"""The supervisor fixes glibc's mmap threshold before its first fork (supervisor/child.py,
``fix_mmap_threshold``): a large block freed in a child goes back to the system even after an
earlier, larger one would have raised glibc's threshold (docs/performance.md, "Memory")."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: In a fresh interpreter: free a 16 MiB block (glibc's threshold climbs to it), then allocate
#: 50 MiB of 256 KiB blocks and free all but the last: how many MiB stayed resident.
PROBE = """
import sys
from supervisor.child import fix_mmap_threshold
def anon_mib():
    with open("/proc/self/status") as status:
        line = next(l for l in status if l.startswith("RssAnon"))
    return int(line.split()[1]) // 1024
if sys.argv[1] == "fixed":
    fix_mmap_threshold()
big = bytearray(16 << 20)
del big
before = anon_mib()
blocks = [bytearray(256 << 10) for _ in range(200)]
last = blocks.pop()
del blocks
print(anon_mib() - before)
"""


def resident_after_freeing(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_freed_leave_nothing_resident_once_the_threshold_is_fixed() -> None:
    assert resident_after_freeing("default") >= 40  # what the fix is for: glibc keeps them
    assert resident_after_freeing("fixed") <= 5
