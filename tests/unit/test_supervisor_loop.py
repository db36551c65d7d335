"""The supervisor's main loop, in-process: no process is forked, no signal sent, no time slept.

The tree runs over ``tests.fakeos.FakeOs`` (the OS seam): each test turns the loop
(``Supervisor.turn``), says when a fake child exits, beats or becomes ready and which signals
reach the supervisor, and reads what the loop did from the fake (children started, signals
sent) and from its log records (their ``action``). Every quiet turn takes the loop's tick of
fake time, as ``select`` would sleep it. tests/chaos/test_supervisor.py proves the same
guarantees with real processes and signals.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import pytest

from supervisor import exitcodes
from supervisor.child import ChildContext
from supervisor.restart import IntensityLimit
from supervisor.spec import ChildSpec, Restart
from supervisor.tree import ABORT_GRACE_S, HANDLED_SIGNALS, TICK_S, Supervisor
from tests.fakeos import FakeChild, FakeOs

SIGTERM, SIGKILL, SIGABRT = signal.SIGTERM, signal.SIGKILL, signal.SIGABRT
EPSILON = 1e-6


def no_target(_ctx: ChildContext) -> int:
    raise AssertionError("a fake child runs no target")


def spec(name: str, **options: Any) -> ChildSpec:
    return ChildSpec(name, no_target, **options)


class Loop:
    """A tree over a fake OS, and the moves a test makes on it."""

    def __init__(
        self, *specs: ChildSpec, exits_on: dict[int, int] | None = None, **options: Any
    ) -> None:
        self.os = FakeOs(exits_on=exits_on)
        self.tree = Supervisor(list(specs), system=self.os, **options)
        self.code: int | None = None

    def turn(self) -> int | None:
        assert self.code is None, f"the tree exited already with {self.code}"
        self.code = self.tree.turn()
        return self.code

    def until(self, condition: Callable[[], object], within_s: float = 120.0) -> float:
        """Turn until ``condition()`` holds; the fake time then. Fails past ``within_s``."""
        deadline = self.os.now + within_s
        while not condition():
            assert self.os.now <= deadline, f"not within {within_s}s of fake time"
            self.turn()
        return self.os.now

    def run_for(self, seconds: float) -> None:
        end = self.os.now + seconds
        self.until(lambda: self.os.now >= end or self.code is not None, seconds + 1.0)

    def gone(self, child: FakeChild) -> float:
        """Turn until ``child`` has exited; the fake time then."""
        return self.until(lambda: not child.alive)

    def exited(self) -> int:
        """Turn until the tree exits; its exit code."""
        self.until(lambda: self.code is not None)
        assert self.code is not None
        return self.code

    def alive(self, name: str | None = None) -> list[FakeChild]:
        return self.os.alive(name)

    def one(self, name: str) -> FakeChild:
        (child,) = self.alive(name)
        return child

    def started(self, name: str) -> list[FakeChild]:
        return [c for c in self.os.children.values() if c.name == name]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    caplog.set_level(logging.DEBUG, logger="supervisor.tree")

    def messages(action: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if getattr(r, "action", None) == action]

    return messages


def crash_and_restart(loop: Loop, name: str, code: int = 1) -> tuple[float, float]:
    """Make the one ``name`` child exit with ``code``; (exit time, its successor's start)."""
    child = loop.one(name)
    loop.os.exit(child.pid, code)
    exited_at = loop.os.now
    loop.until(lambda: loop.alive(name))
    return exited_at, loop.one(name).started_at


# ------------------------------------------------------------------ starting and reaping


def test_the_first_turn_starts_every_child_with_its_context() -> None:
    loop = Loop(spec("scheduler"), spec("worker", count=2, scalable=True))
    loop.turn()
    assert [c.name for c in loop.alive()] == ["scheduler", "worker", "worker"]
    workers = loop.alive("worker")
    assert [(c.ctx.instance, c.ctx.count) for c in workers] == [(1, 2), (2, 2)]
    assert workers[0].ctx.spec_names == ("scheduler", "worker")
    assert len({c.ctx.slot for c in loop.alive()}) == 3
    assert loop.tree.readiness() == {"scheduler": (0, 1), "worker": (0, 2)}


def test_run_supervises_inside_the_seam_and_returns_the_exit_code() -> None:
    loop = Loop(spec("idle"), exits_on={SIGTERM: 0})
    seen: list[bool] = []
    spawn = loop.os.spawn

    def spawn_while_supervising(target: Callable[[ChildContext], int], ctx: ChildContext) -> int:
        seen.append(loop.os.supervised)
        return spawn(target, ctx)

    loop.os.spawn = spawn_while_supervising  # type: ignore[method-assign]
    loop.os.deliver(SIGTERM)
    assert loop.tree.run() == exitcodes.CLEAN
    assert seen == [True] and not loop.os.supervised
    assert loop.started("idle")[0].signals == [SIGTERM]
    assert set(HANDLED_SIGNALS) >= {SIGTERM, signal.SIGCHLD, signal.SIGHUP}


def test_ready_children_are_reported_once_when_the_whole_tree_is_ready() -> None:
    reports: list[dict[str, tuple[int, int]]] = []
    loop = Loop(spec("a"), spec("b", count=2), on_ready=reports.append)
    loop.turn()
    for child in loop.alive()[:2]:
        loop.os.ready(child.pid)
    loop.run_for(1.0)
    assert reports == []
    loop.os.ready(loop.alive()[2].pid)
    loop.run_for(1.0)
    assert reports == [{"a": (1, 1), "b": (2, 2)}]


def test_every_exit_is_reaped_in_one_turn_and_unknown_pids_too(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("worker", count=3))
    loop.turn()
    first, second, third = loop.alive()
    loop.os.exit(first.pid, 1)
    loop.os.orphan_exits(4242)  # a reparented grandchild
    loop.os.exit(second.pid, -SIGKILL)
    loop.turn()
    assert loop.alive() == [third]
    assert logged("reaped_orphan") == ["reaped pid 4242, not one of ours"]
    died = logged("child_died")
    assert len(died) == 2
    assert f"(pid {first.pid}) exited with code 1" in died[0]
    assert f"(pid {second.pid}) killed by SIGKILL — out of memory?" in died[1]
    loop.until(lambda: len(loop.alive()) == 3)  # both slots come back, the orphan adds none
    assert sorted(c.ctx.instance for c in loop.alive()) == [1, 2, 3]


def test_a_child_killed_by_a_signal_without_a_name_is_restarted(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("idle"))
    loop.turn()
    child = loop.one("idle")
    loop.os.exit(child.pid, -(signal.SIGRTMIN + 1))  # not a member of signal.Signals
    loop.until(lambda: loop.alive("idle"))
    (died,) = logged("child_died")
    assert f"(pid {child.pid}) killed by signal {signal.SIGRTMIN + 1};" in died
    assert loop.code is None


# ------------------------------------------------------------------ restarts


def test_a_crashing_child_is_restarted_after_a_delay_doubling_to_30s(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("worker"), intensity=IntensityLimit(1000, 60.0))
    loop.turn()
    expected = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    for delay in expected:
        exited_at, restarted_at = crash_and_restart(loop, "worker")
        assert delay - EPSILON <= restarted_at - exited_at <= delay + TICK_S + EPSILON
    assert [m.rsplit("restarting in ", 1)[1] for m in logged("child_died")] == [
        f"{d:.1f}s" for d in expected
    ]


def test_each_slot_has_its_own_backoff() -> None:
    loop = Loop(spec("worker", count=2), intensity=IntensityLimit(1000, 60.0))
    loop.turn()
    one, two = loop.alive()
    for _ in range(3):  # slot 1 backs off to 4 s ...
        loop.os.exit(next(c for c in loop.alive() if c.ctx.instance == 1).pid, 1)
        loop.until(lambda: len(loop.alive()) == 2)
    loop.os.exit(two.pid, 1)  # ... slot 2's first crash still waits only 0.5 s
    exited_at = loop.os.now
    loop.until(lambda: len(loop.alive()) == 2)
    (successor,) = [c for c in loop.alive() if c.ctx.instance == 2]
    assert successor.started_at - exited_at <= 0.5 + TICK_S + EPSILON
    assert one.pid not in {c.pid for c in loop.alive()}


def test_the_backoff_resets_after_10s_up_and_ready_but_not_up_alone() -> None:
    loop = Loop(spec("worker"), intensity=IntensityLimit(1000, 600.0))
    loop.turn()
    for _ in range(3):  # 0.5, 1, 2: the next delay would be 4 s
        crash_and_restart(loop, "worker")
    loop.run_for(11.0)  # up for 11 s, but never ready: still doubling
    exited_at, restarted_at = crash_and_restart(loop, "worker")
    assert restarted_at - exited_at >= 4.0 - EPSILON
    loop.os.ready(loop.one("worker").pid)
    loop.run_for(9.0)  # ready, but up for less than 10 s: still doubling
    exited_at, restarted_at = crash_and_restart(loop, "worker")
    assert restarted_at - exited_at >= 8.0 - EPSILON
    loop.os.ready(loop.one("worker").pid)
    loop.run_for(10.0)  # up and ready for 10 s: healthy, back to the base
    exited_at, restarted_at = crash_and_restart(loop, "worker")
    assert restarted_at - exited_at <= 0.5 + TICK_S + EPSILON


def test_more_than_n_restarts_in_p_seconds_drains_the_tree_and_exits_4(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(
        spec("scheduler"),
        spec("worker"),
        intensity=IntensityLimit(max_restarts=3, period_s=60.0),
        exits_on={SIGTERM: 0},
    )
    loop.turn()
    for _ in range(3):
        crash_and_restart(loop, "worker")
    loop.os.exit(loop.one("worker").pid, 1)  # the fourth within 60 s trips the limit
    assert loop.exited() == exitcodes.RESTART_LIMIT
    assert len(loop.started("worker")) == 4
    assert [m.rsplit("restarting in ", 1)[1] for m in logged("child_died")] == [
        "0.5s",
        "1.0s",
        "2.0s",
    ]
    assert len(logged("restart_limit")) == 1
    assert loop.started("scheduler")[0].signals == [SIGTERM]  # drained, not killed


def test_restarts_spread_wider_than_the_period_never_trip_the_limit() -> None:
    loop = Loop(spec("worker"), intensity=IntensityLimit(max_restarts=2, period_s=5.0))
    loop.turn()
    for _ in range(10):
        crash_and_restart(loop, "worker")
        loop.os.ready(loop.one("worker").pid)
        loop.run_for(10.0)  # healthy each time: the delay stays 0.5 s
    assert loop.code is None and len(loop.started("worker")) == 11


def test_a_boot_failure_stops_the_tree_with_3_and_restarts_nothing(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("scheduler"), spec("worker", count=2), exits_on={SIGTERM: 0})
    loop.turn()
    loop.os.exit(loop.alive("worker")[0].pid, exitcodes.CHILD_BOOT_FAILURE)
    assert loop.exited() == exitcodes.BOOT_FAILED
    assert len(loop.os.children) == 3, "nothing may be started again"
    assert len(logged("boot_failed")) == 1 and not logged("child_died")


def test_a_recycled_child_is_replaced_at_once_and_not_counted(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("worker"), intensity=IntensityLimit(max_restarts=1, period_s=60.0))
    loop.turn()
    for _ in range(5):
        exited_at, restarted_at = crash_and_restart(loop, "worker", exitcodes.CHILD_RECYCLE)
        assert restarted_at == exited_at  # on the turn after the reap, no time passed
    assert len(logged("child_recycled")) == 5 and not logged("restart_limit")
    exited_at, restarted_at = crash_and_restart(loop, "worker")  # a crash: the first backoff
    assert restarted_at - exited_at >= 0.5 - EPSILON
    assert loop.code is None


@pytest.mark.parametrize(
    ("restart", "code", "again"),
    [
        (Restart.PERMANENT, 0, True),
        (Restart.PERMANENT, 1, True),
        (Restart.TRANSIENT, 0, False),
        (Restart.TRANSIENT, 1, True),
        (Restart.TRANSIENT, -SIGKILL, True),
        (Restart.TEMPORARY, 0, False),
        (Restart.TEMPORARY, 1, False),
        (Restart.TEMPORARY, -SIGKILL, False),
    ],
)
def test_restart_types_decide_whether_an_exited_child_comes_back(
    restart: Restart, code: int, again: bool, logged: Callable[[str], list[str]]
) -> None:
    loop = Loop(spec("job", restart=restart), spec("idle"))
    loop.turn()
    loop.os.exit(loop.one("job").pid, code)
    loop.run_for(5.0)
    assert len(loop.started("job")) == (2 if again else 1)
    assert len(logged("child_finished")) == (0 if again else 1)
    assert loop.code is None and len(loop.alive("idle")) == 1  # the tree goes on either way


# ------------------------------------------------------------------ stopping


def drain_tree(**options: Any) -> Loop:
    loop = Loop(
        spec("scheduler", stop_group=0),
        spec("worker", count=2, stop_group=1, shutdown_timeout_s=30.0),
        spec("publisher", stop_group=2),
        **options,
    )
    loop.turn()
    return loop


def signalled(loop: Loop) -> dict[str, list[list[int]]]:
    names = ("scheduler", "worker", "publisher")
    return {n: [c.signals for c in loop.started(n)] for n in names}


def test_sigterm_stops_the_groups_in_order_each_awaited_and_exits_0(
    logged: Callable[[str], list[str]],
) -> None:
    loop = drain_tree()
    scheduler, publisher = loop.one("scheduler"), loop.one("publisher")
    one, two = loop.alive("worker")
    loop.os.deliver(SIGTERM)
    loop.run_for(3.0)
    assert signalled(loop) == {"scheduler": [[SIGTERM]], "worker": [[], []], "publisher": [[]]}
    loop.os.exit(scheduler.pid, 0)
    loop.run_for(3.0)
    assert signalled(loop) == {
        "scheduler": [[SIGTERM]],
        "worker": [[SIGTERM], [SIGTERM]],
        "publisher": [[]],
    }
    loop.os.exit(one.pid, 0)
    loop.run_for(3.0)  # one worker still finishes its task: the publisher waits
    assert publisher.signals == []
    loop.os.exit(two.pid, 0)
    loop.turn()
    loop.turn()
    assert publisher.signals == [SIGTERM]
    loop.os.exit(publisher.pid, 0)
    assert loop.exited() == exitcodes.CLEAN
    assert len(loop.os.children) == 4, "nothing is restarted while draining"
    stopped = [m.split(" ", 1)[0] for m in logged("child_stopped")]
    assert stopped == ["scheduler-1", "worker-1", "worker-2", "publisher-1"]
    assert not logged("drain_timeout") and not logged("child_died")


def test_a_child_past_its_shutdown_timeout_is_killed_and_the_drain_goes_on() -> None:
    loop = drain_tree(exits_on={})
    scheduler = loop.one("scheduler")  # ignores SIGTERM; its shutdown timeout is 10 s
    loop.os.deliver(SIGTERM)
    loop.turn()
    term_at = loop.os.now
    killed_at = loop.until(lambda: SIGKILL in scheduler.signals)
    assert 10.0 < killed_at - term_at <= 10.0 + 2 * TICK_S
    loop.until(lambda: all(w.signals == [SIGTERM] for w in loop.started("worker")))


def test_at_the_drain_deadline_what_remains_is_killed_and_the_tree_exits_0(
    logged: Callable[[str], list[str]],
) -> None:
    loop = drain_tree(drain_timeout_s=25.0, exits_on={SIGTERM: 0})
    stubborn = loop.alive("worker")[0]
    loop.os.exits_on = {}  # the workers ignore SIGTERM (their own timeout: 30 s)
    loop.os.deliver(SIGTERM)
    loop.turn()
    began = loop.os.now
    loop.os.exit(loop.one("scheduler").pid, 0)
    loop.until(lambda: stubborn.signals == [SIGTERM])
    loop.os.exit(loop.alive("worker")[1].pid, 0)
    killed_at = loop.until(lambda: SIGKILL in stubborn.signals)
    assert 25.0 <= killed_at - began <= 25.0 + 2 * TICK_S
    assert loop.started("publisher")[0].signals == [SIGKILL]  # never asked: the time was up
    assert loop.exited() == exitcodes.CLEAN
    assert len(logged("drain_timeout")) == 1


@pytest.mark.parametrize("second", [SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_a_second_sigterm_or_a_sigquit_kills_every_child_at_once(
    second: int, logged: Callable[[str], list[str]]
) -> None:
    loop = drain_tree()
    loop.os.deliver(signal.SIGINT)  # SIGINT drains as SIGTERM does
    loop.run_for(1.0)
    assert logged("draining") and loop.one("scheduler").signals == [SIGTERM]
    loop.os.deliver(second)
    loop.turn()
    assert not loop.alive()
    assert signalled(loop) == {
        "scheduler": [[SIGTERM, SIGKILL]],
        "worker": [[SIGKILL], [SIGKILL]],
        "publisher": [[SIGKILL]],
    }
    assert loop.exited() == exitcodes.CLEAN
    assert len(logged("fast_stop")) == 1


def test_sigquit_while_running_kills_everything_without_draining(
    logged: Callable[[str], list[str]],
) -> None:
    loop = drain_tree()
    loop.os.deliver(signal.SIGQUIT)
    assert loop.exited() == exitcodes.CLEAN
    assert all(s == [[SIGKILL]] * len(s) for s in signalled(loop).values())
    assert not logged("draining")


# ------------------------------------------------------------------ scaling


def test_sigttin_and_sigttou_scale_the_scalable_specs_never_below_one(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("scheduler"), spec("worker", count=2, scalable=True), exits_on={SIGTERM: 0})
    loop.turn()
    loop.os.deliver(signal.SIGTTIN)
    loop.turn()
    loop.turn()
    workers = loop.alive("worker")
    assert [(c.ctx.instance, c.ctx.count) for c in workers] == [(1, 2), (2, 2), (3, 3)]
    assert loop.tree.readiness()["worker"] == (0, 3)
    assert len(loop.alive("scheduler")) == 1
    for _ in range(4):  # 3 → 2 → 1 → 1 → 1
        loop.os.deliver(signal.SIGTTOU)
        loop.run_for(1.0)
    assert loop.alive("worker") == [workers[0]]
    assert [c.signals for c in workers] == [[], [SIGTERM], [SIGTERM]]
    assert loop.tree.readiness()["worker"] == (0, 1)
    assert [m.split(": ", 1)[1] for m in logged("scaled")] == [
        "now 3 wanted",
        "now 2 wanted",
        "now 1 wanted",
        "now 1 wanted",
        "now 1 wanted",
    ]
    assert len(logged("child_stopped")) == 2 and not logged("child_died")
    loop.os.deliver(SIGTERM)
    loop.os.deliver(signal.SIGTTIN)  # ignored while draining
    assert loop.exited() == exitcodes.CLEAN
    assert len(loop.started("worker")) == 3


def test_a_retired_child_that_ignores_sigterm_is_killed_after_its_shutdown_timeout() -> None:
    loop = Loop(spec("worker", count=2, scalable=True, shutdown_timeout_s=5.0))
    loop.turn()
    retired = loop.alive("worker")[1]
    loop.os.deliver(signal.SIGTTOU)
    loop.until(lambda: retired.signals)  # SIGTERM on the turn after the signal, at once
    assert retired.signals == [SIGTERM]
    loop.run_for(5.0 - 2 * TICK_S)
    assert retired.alive
    loop.run_for(3 * TICK_S)
    assert retired.signals == [SIGTERM, SIGKILL] and not retired.alive


# ------------------------------------------------------------------ rolling restart


def test_sighup_replaces_each_rolling_child_new_ready_before_old_stopped(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("roller", count=2, rolling=True), spec("fixed"), exits_on={SIGTERM: 0})
    loop.turn()
    old = loop.alive("roller")
    fixed = loop.one("fixed")
    for child in loop.alive():
        loop.os.ready(child.pid)
    loop.run_for(1.0)
    loop.os.deliver(signal.SIGHUP)
    replaced: list[FakeChild] = []
    for predecessor in old:
        loop.until(lambda: len(loop.started("roller")) == 2 + len(replaced) + 1)
        successor = loop.started("roller")[-1]
        assert successor.ctx.instance == predecessor.ctx.instance
        loop.run_for(30.0)  # a slow boot: the old one keeps serving meanwhile
        assert predecessor.signals == [] and len(loop.alive("roller")) == 3
        loop.os.ready(successor.pid)
        loop.gone(predecessor)
        assert predecessor.signals == [SIGTERM]
        replaced.append(successor)
    loop.run_for(5.0)
    assert loop.alive("roller") == replaced and fixed.alive and fixed.signals == []
    assert len(logged("child_stopped")) == 2 and not logged("child_died")
    assert len(logged("rolling")) == 1


def test_a_rolling_restart_ends_when_the_tree_drains() -> None:
    loop = Loop(spec("roller", count=2, rolling=True), exits_on={SIGTERM: 0})
    loop.turn()
    loop.os.deliver(signal.SIGHUP)
    loop.until(lambda: len(loop.started("roller")) == 3)
    loop.os.deliver(SIGTERM)
    assert loop.exited() == exitcodes.CLEAN
    assert len(loop.started("roller")) == 3, "no replacement is started while draining"


# ------------------------------------------------------------------ liveness


def test_a_silent_child_gets_sigabrt_then_sigkill_after_2s_and_is_replaced(
    logged: Callable[[str], list[str]],
) -> None:
    loop = Loop(spec("hanger", liveness_timeout_s=5.0), spec("beater", liveness_timeout_s=5.0))
    loop.turn()
    hanger, beater = loop.one("hanger"), loop.one("beater")
    started = hanger.started_at

    def beat_until_the_abort() -> bool:
        loop.os.beat(beater.pid)
        return SIGABRT in hanger.signals

    aborted_at = loop.until(beat_until_the_abort)
    assert 5.0 < aborted_at - started <= 5.0 + 2 * TICK_S
    assert logged("child_hung") == [
        f"hanger-1 (pid {hanger.pid}) is hung: silent for over 5s; aborting it"
    ]
    killed_at = loop.until(lambda: SIGKILL in hanger.signals)
    assert ABORT_GRACE_S < killed_at - aborted_at <= ABORT_GRACE_S + 2 * TICK_S
    loop.until(lambda: loop.alive("hanger"))
    assert beater.signals == [] and beater.alive
    assert "killed by SIGKILL" in logged("child_died")[0]


def test_a_child_that_dies_of_the_sigabrt_is_replaced_without_a_sigkill() -> None:
    loop = Loop(spec("hanger", liveness_timeout_s=1.0), exits_on={SIGABRT: -SIGABRT})
    loop.turn()
    hanger = loop.one("hanger")
    loop.gone(hanger)
    loop.until(lambda: loop.alive("hanger"))
    assert hanger.signals == [SIGABRT]


def test_a_child_without_a_liveness_timeout_may_stay_silent() -> None:
    loop = Loop(spec("quiet"))
    loop.turn()
    loop.run_for(300.0)
    assert loop.one("quiet").signals == []


def test_sigusr1_logs_a_status_line_per_child(logged: Callable[[str], list[str]]) -> None:
    loop = Loop(spec("worker", count=2))
    loop.turn()
    loop.os.ready(loop.alive()[0].pid)
    loop.os.deliver(signal.SIGUSR1)
    loop.turn()
    (status,) = logged("status")
    lines = status.splitlines()
    assert lines[0] == "status (running):" and lines[1].startswith("CHILD")
    assert [line.split()[0] for line in lines[2:]] == ["worker-1", "worker-2"]
    assert [line.split()[3] for line in lines[2:]] == ["yes", "no"]
