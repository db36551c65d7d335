"""SIGHUP's rolling restart as a reload (issue 21), over the fake OS like
tests/unit/test_supervisor_loop.py: the order children are replaced in, its end in the log, a
SIGHUP during one, and a replacement whose new code does not run (failure mode 99)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from supervisor import exitcodes
from tests.fakeos import FakeChild
from tests.unit.test_supervisor_loop import Loop, logged, spec

SIGTERM = signal.SIGTERM
__all__ = ["logged"]  # the fixture: the supervisor's log records by action


def ready_tree() -> Loop:
    """api (roll 2), scheduler (roll 1), two workers (roll 0) and a publisher (not rolled),
    in the specs' order of flowforge/up.py, every child ready."""
    loop = Loop(
        spec("scheduler", rolling=True, roll_order=1),
        spec("worker", count=2, rolling=True),
        spec("publisher"),
        spec("api", rolling=True, roll_order=2),
        exits_on={SIGTERM: 0},
    )
    loop.turn()
    for child in loop.alive():
        loop.os.ready(child.pid)
    loop.run_for(1.0)
    return loop


def replace_next(loop: Loop) -> FakeChild:
    """Turn until the rolling restart starts a replacement; make it ready; return it."""
    before = set(loop.os.children)
    loop.until(lambda: set(loop.os.children) - before)
    (pid,) = set(loop.os.children) - before
    loop.os.ready(pid)
    return loop.os.children[pid]


def test_sighup_replaces_the_workers_then_the_scheduler_then_the_api_and_says_when_done(
    logged: Callable[[str], list[str]],
) -> None:
    loop = ready_tree()
    publisher = loop.one("publisher")
    loop.os.deliver(signal.SIGHUP)
    order = [replace_next(loop).name for _ in range(4)]
    assert order == ["worker", "worker", "scheduler", "api"]
    loop.until(lambda: logged("rolled"))
    assert logged("rolled") == ["rolling restart done: 4 child(ren) replaced"]
    assert publisher.alive and publisher.signals == []
    assert [c.name for c in loop.alive()] == ["publisher", *order]


def test_a_replacement_that_cannot_boot_stops_the_reload_and_the_old_child_keeps_serving(
    logged: Callable[[str], list[str]],
) -> None:
    loop = ready_tree()
    old_workers = loop.alive("worker")
    old_scheduler, old_api = loop.one("scheduler"), loop.one("api")
    loop.os.deliver(signal.SIGHUP)
    new_worker = replace_next(loop)  # the first worker is replaced
    before = set(loop.os.children)
    loop.until(lambda: set(loop.os.children) - before)
    (broken,) = set(loop.os.children) - before
    loop.os.exit(broken, exitcodes.CHILD_BOOT_FAILURE)  # the second one's new code fails
    loop.run_for(30.0)
    assert loop.code is None, "a reload that fails must not stop the tree"
    assert not logged("boot_failed") and not logged("draining") and not logged("child_died")
    (failed,) = logged("reload_failed")
    assert f"worker-2 (pid {broken}) exited with code 78" in failed
    assert "2 more child(ren) not replaced" in failed  # the scheduler and the api
    assert loop.alive("worker") == [old_workers[1], new_worker]
    assert old_scheduler.alive and old_api.alive and old_api.signals == []
    assert not logged("rolled")
    assert len(loop.os.children) == 7, "nothing was started after the failure"
    loop.os.deliver(signal.SIGHUP)  # fixed: the next reload replaces what is left
    assert [replace_next(loop).name for _ in range(4)] == ["worker", "worker", "scheduler", "api"]


def test_a_sighup_during_a_rolling_restart_starts_it_over_finishing_the_replacement_under_way(
    logged: Callable[[str], list[str]],
) -> None:
    loop = ready_tree()
    loop.os.deliver(signal.SIGHUP)
    first = replace_next(loop)
    before = set(loop.os.children)
    loop.until(lambda: set(loop.os.children) - before)
    (booting,) = set(loop.os.children) - before  # replaces worker-2
    old_second = loop.alive("worker")[0]
    loop.os.deliver(signal.SIGHUP)  # files changed again meanwhile
    loop.turn()
    loop.os.ready(booting)
    loop.until(lambda: not old_second.alive)
    # the new round: both workers (the one replaced first loaded older files), then the rest
    order = [replace_next(loop) for _ in range(4)]
    assert [c.name for c in order] == ["worker", "worker", "scheduler", "api"]
    loop.until(lambda: logged("rolled"))
    assert not first.alive and not loop.os.children[booting].alive
    assert sorted(c.pid for c in loop.alive("worker")) == sorted(c.pid for c in order[:2])
