"""What the supervisor's loop tells systemd (``Type=notify``), in order and on the fake clock.

The tree runs over ``tests.fakeos.FakeOs`` as in test_supervisor_loop.py; every message the loop
sends to the service manager is in ``FakeOs.notified`` with the fake time it was sent. The
real protocol client is tested in test_notify.py, and a real ``flowforge up`` against a stand-in
notify socket in tests/integration/test_up_systemd.py.
"""

from __future__ import annotations

import itertools
import signal
from typing import Any

from supervisor import exitcodes
from supervisor.service import ServiceNotifications
from supervisor.spec import ChildSpec
from supervisor.tree import TICK_S
from tests.fakeos import FakeOs
from tests.unit.test_supervisor_loop import Loop, spec

SIGTERM, SIGHUP = signal.SIGTERM, signal.SIGHUP
EPSILON = 1e-6


def messages(loop: Loop) -> list[tuple[str, ...]]:
    """Every message so far, without the watchdog's."""
    return [fields for _at, fields in loop.os.notified if fields != ("WATCHDOG=1",)]


def sent(loop: Loop, field: str) -> list[float]:
    """When each message holding ``field`` was sent (fake time)."""
    return [at for at, fields in loop.os.notified if field in fields]


def statuses(loop: Loop) -> list[str]:
    return [f.removeprefix("STATUS=") for m in messages(loop) for f in m if f.startswith("STATUS=")]


def ready_tree(*specs: ChildSpec, **options: Any) -> Loop:
    """A tree whose every child reported ready, past its READY=1."""
    loop = Loop(*specs, **options)
    loop.turn()
    for child in loop.alive():
        loop.os.ready(child.pid)
    loop.until(lambda: sent(loop, "READY=1"))
    return loop


# ------------------------------------------------------------------ ready


def test_ready_is_sent_once_only_after_every_child_of_every_spec_is_ready() -> None:
    loop = Loop(spec("scheduler"), spec("worker", count=2))
    loop.turn()
    scheduler, one, two = loop.alive()
    assert statuses(loop) == ["starting: scheduler 0/1, worker 0/2"]
    loop.os.ready(one.pid)
    loop.os.ready(scheduler.pid)
    loop.run_for(30.0)
    assert not sent(loop, "READY=1")
    loop.os.ready(two.pid)
    last_ready_at = loop.os.now
    loop.turn()
    assert messages(loop)[-1] == ("READY=1", "STATUS=ready: scheduler 1/1, worker 2/2")
    (ready_at,) = sent(loop, "READY=1")
    assert last_ready_at <= ready_at <= last_ready_at + TICK_S  # at the end of that very turn
    assert statuses(loop) == [
        "starting: scheduler 0/1, worker 0/2",
        "starting: scheduler 1/1, worker 1/2",  # one status per change, not one per turn
        "ready: scheduler 1/1, worker 2/2",
    ]
    loop.run_for(60.0)
    assert len(sent(loop, "READY=1")) == 1 and len(statuses(loop)) == 3


def test_a_child_that_dies_after_ready_shows_degraded_then_ready_without_a_second_ready() -> None:
    loop = ready_tree(spec("scheduler"), spec("worker", count=2))
    worker = loop.alive("worker")[1]
    loop.os.exit(worker.pid, 1)
    loop.until(lambda: len(loop.alive("worker")) == 2)
    assert statuses(loop)[-1] == (
        f"degraded: scheduler 1/1, worker 1/2; worker-2 (pid {worker.pid}) exited with code 1; "
        "restarting in 0.5s"
    )
    loop.os.ready(loop.alive("worker")[1].pid)
    loop.turn()
    assert statuses(loop)[-1] == "ready: scheduler 1/1, worker 2/2"
    assert len(sent(loop, "READY=1")) == 1


# ------------------------------------------------------------------ watchdog


def test_the_watchdog_is_petted_from_the_first_turn_every_interval_within_a_tick() -> None:
    loop = Loop(spec("worker"))
    loop.os.watchdog_s = 5.0  # WATCHDOG_USEC=10000000: every 5 s
    started = loop.os.now
    loop.turn()
    loop.run_for(60.0)
    pets = sent(loop, "WATCHDOG=1")
    assert pets[0] == started + TICK_S  # the end of the first turn, which slept one tick
    gaps = [b - a for a, b in itertools.pairwise(pets)]
    assert len(gaps) >= 10
    assert all(5.0 - EPSILON <= gap <= 5.0 + TICK_S + EPSILON for gap in gaps), gaps


def test_a_stalled_loop_stops_petting_the_watchdog() -> None:
    loop = Loop(spec("worker"))
    loop.os.watchdog_s = 5.0
    loop.run_for(10.0)
    before = sent(loop, "WATCHDOG=1")[-1]
    wait = loop.os.wait_for_signals

    def stuck(timeout_s: float) -> list[int]:  # a turn that takes a minute (a wedged call)
        loop.os.advance(60.0)
        return wait(timeout_s)

    loop.os.wait_for_signals = stuck  # type: ignore[method-assign]
    loop.turn()
    loop.os.wait_for_signals = wait  # type: ignore[method-assign]
    after = sent(loop, "WATCHDOG=1")[-1]
    assert after - before >= 60.0, "no pet while the loop was stuck: systemd's timeout passes"
    loop.run_for(10.0)
    assert len([t for t in sent(loop, "WATCHDOG=1") if t > after]) == 2  # back at its cadence


def test_no_watchdog_is_petted_when_the_manager_asks_for_none() -> None:
    loop = Loop(spec("worker"))
    loop.run_for(60.0)
    assert not sent(loop, "WATCHDOG=1")
    assert statuses(loop) == ["starting: worker 0/1"]


# ------------------------------------------------------------------ stopping


def test_sigterm_sends_stopping_once_then_counts_the_children_down() -> None:
    loop = ready_tree(
        spec("scheduler", stop_group=0), spec("worker", count=2, stop_group=1), exits_on={}
    )
    loop.os.exits_on = {SIGTERM: 0}
    loop.os.deliver(SIGTERM)
    loop.turn()
    draining = "draining (received SIGTERM) within 25s"
    assert messages(loop)[-1] == ("STOPPING=1", f"STATUS={draining}: 3 child(ren) left")
    assert loop.exited() == exitcodes.CLEAN
    assert len(sent(loop, "STOPPING=1")) == 1
    assert statuses(loop)[-2:] == [
        f"{draining}: 3 child(ren) left",
        f"{draining}: 2 child(ren) left",
    ]
    order = [f for m in messages(loop) for f in m if f in ("READY=1", "STOPPING=1")]
    assert order == ["READY=1", "STOPPING=1"]


def test_a_boot_failure_says_why_the_tree_stops() -> None:
    loop = Loop(spec("scheduler"), spec("worker"), exits_on={SIGTERM: 0})
    loop.turn()
    loop.os.exit(loop.one("worker").pid, exitcodes.CHILD_BOOT_FAILURE)
    assert loop.exited() == exitcodes.BOOT_FAILED
    assert not sent(loop, "READY=1")
    (stopping,) = [m for m in messages(loop) if "STOPPING=1" in m]
    assert stopping == (
        "STOPPING=1",
        "STATUS=draining (worker failed to boot) within 25s: 1 child(ren) left",
    )


def test_sigquit_kills_at_once_with_one_stopping() -> None:
    loop = ready_tree(spec("worker", count=2), exits_on={SIGTERM: 0})
    loop.os.deliver(SIGTERM)
    loop.turn()
    loop.os.exits_on = {}
    loop.os.deliver(signal.SIGQUIT)
    assert loop.exited() == exitcodes.CLEAN
    assert len(sent(loop, "STOPPING=1")) == 1
    assert "fast stop (received SIGQUIT): 2 child(ren) left" in statuses(loop)


# ------------------------------------------------------------------ reload


def test_sighup_sends_reloading_with_its_monotonic_time_and_ready_once_all_are_replaced() -> None:
    loop = ready_tree(spec("roller", count=2, rolling=True), spec("fixed"), exits_on={SIGTERM: 0})
    old = loop.alive("roller")
    loop.os.deliver(SIGHUP)
    loop.turn()
    ((at, reloading),) = [(at, m) for at, m in loop.os.notified if "RELOADING=1" in m]
    assert reloading == (
        "RELOADING=1",
        f"MONOTONIC_USEC={int(at * 1_000_000)}",  # the clock the loop runs on: CLOCK_MONOTONIC
        "STATUS=reloading: rolling restart of 2 child(ren)",
    )
    assert len(sent(loop, "READY=1")) == 1  # the first one, at start
    for predecessor in old:
        loop.until(lambda: len(loop.alive("roller")) == 3)
        successor = loop.alive("roller")[-1]
        loop.run_for(5.0)
        assert len(sent(loop, "READY=1")) == 1, "not before every rolling child is replaced"
        loop.os.ready(successor.pid)
        last_ready_at = loop.os.now
        loop.gone(predecessor)
    loop.turn()
    assert last_ready_at <= sent(loop, "READY=1")[-1] <= last_ready_at + TICK_S
    assert len(sent(loop, "READY=1")) == 2
    reloaded = [m for m in messages(loop) if "READY=1" in m][-1]
    assert reloaded == ("READY=1", "STATUS=ready: roller 3/2, fixed 1/1")  # the last old one stops
    assert statuses(loop)[-1] == "ready: roller 2/2, fixed 1/1"
    reload_statuses = statuses(loop)[
        statuses(loop).index("reloading: rolling restart of 2 child(ren)") :
    ]
    assert reload_statuses[1].startswith("reloading: rolling restart, 2 of 2 left; roller ")
    assert any(s.startswith("reloading: rolling restart, 1 of 2 left; ") for s in reload_statuses)


def test_sighup_before_the_tree_was_ready_is_no_reload() -> None:
    loop = Loop(spec("roller", count=2, rolling=True), exits_on={SIGTERM: 0})
    loop.turn()
    loop.os.deliver(SIGHUP)
    loop.run_for(2.0)
    assert not sent(loop, "RELOADING=1")
    for child in loop.alive():
        loop.os.ready(child.pid)
    loop.until(lambda: sent(loop, "READY=1"))
    assert len(sent(loop, "READY=1")) == 1


def test_a_status_is_one_line_whatever_a_name_holds() -> None:
    system = FakeOs()
    service = ServiceNotifications(system)
    service.running("bad\nname 0/1", whole=False, rolling=0)
    assert system.notified == [(system.now, ("STATUS=starting: bad name 0/1",))]
