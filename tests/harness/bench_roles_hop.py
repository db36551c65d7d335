"""The worker's own CPU per chain hop, without PostgreSQL or RabbitMQ (issue 22; docs/
performance.md "The worker's side of a hop").

Runs the real :class:`~flowforge.roles.worker.Worker` loop (its handler thread and lease keeper
too) over :class:`tests.stubs.FakeStore` and :class:`tests.stubs.StubBroker` on a ``--steps``
chain of no-op handlers, every step claimed by the finish before it, and prints the process's
CPU and wall time per hop: what ``flowforge/roles/`` and the thread hand-offs cost, the fake
store's few microseconds included. The broker's turn is kept out (``PUMP_INTERVAL_S`` raised):
the stub broker has nobody to publish a step sent out as a message. ``--profile`` prints
cProfile's top functions of the main thread. Run alone::

    python -m tests.harness.bench_roles_hop [--steps 20000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import sys
import threading
import time
from typing import Any

from flowforge.domain.states import TaskState
from flowforge.roles import intake
from tests.unit.test_worker_loop import make_rig

#: How often the watcher looks whether the chain's last step finished (seconds).
LOOK_S = 0.01


class _Nothing(list[Any]):
    """A journal that keeps nothing: the rig's would grow by a few entries a hop."""

    def append(self, item: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("bench_roles_hop", description=__doc__)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    intake.PUMP_INTERVAL_S = 1e9
    rig = make_rig()
    rig.broker.on_idle = None
    steps = rig.store.add("fast", 1) + rig.store.add(
        "fast", args.steps - 1, state=TaskState.PENDING
    )
    for before, after in itertools.pairwise(steps):
        rig.store.then(before, after)
    rig.broker.publish(steps[0], 1)
    rig.store.calls = rig.broker.events = _Nothing()
    last = rig.store.tasks[steps[-1]]
    done = threading.Event()

    def watch() -> None:  # bounded by the loop's own end: done is set right after it
        while last.state is not TaskState.SUCCEEDED and not done.wait(LOOK_S):
            continue
        rig.stop.set()

    rig.worker.initialize()
    threading.Thread(target=watch, daemon=True).start()
    profile = cProfile.Profile() if args.profile else None
    cpu, wall = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    rig.worker.loop(rig.stop, lambda: None)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done.set()
    rig.worker.shutdown()
    hops = sum(1 for t in rig.store.tasks.values() if t.state is TaskState.SUCCEEDED)
    print(f"hops {hops}  cpu {1e6 * cpu / hops:.1f} us/hop  wall {1e6 * wall / hops:.1f} us/hop")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
