"""flowforge.orphans: a child started with stop_with_parent ends when its parent dies."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e import REPO
from tests.helpers import wait_for
from tests.trees import alive

STARTER = """
import functools, os, subprocess, sys
from flowforge.orphans import stop_with_parent
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(60)"],
    preexec_fn=functools.partial(stop_with_parent, os.getpid()),
)
print(child.pid, flush=True)
os._exit(0)  # killed, as far as the child can tell: nobody waits for it or stops it
"""


def test_a_child_started_with_stop_with_parent_ends_when_its_parent_dies() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STARTER],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = int(done.stdout.split()[0])
    wait_for(lambda: not alive(child), timeout=10, what="the orphaned child to stop")
