"""A role's :class:`~flowforge.roles.stopping.Stop`: setting it wakes the waits that watch it.

The event itself (its pipe, its wakers, once each), the plain-event fallback, and the worker's
loop registering its broker's wake (through the stub broker). The waits woken through real
servers — pika's consumer and publisher, the scheduler's LISTEN, waitress — are proven in
tests/integration/test_stop_wakes.py; that a woken role still drains, by the drain tests of
tests/integration/test_roles_delivery.py and tests/chaos/test_supervisor.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from flowforge.roles.stopping import Stop, on_stop, stop_fd, wait_readable
from tests.unit.test_worker_loop import make_rig

#: A bound on a wait the stop must end (seconds): never reached when the wake works.
BOUND_S = 30.0


@pytest.fixture
def stop() -> Iterator[Stop]:
    made = Stop()
    yield made
    made.close()


def test_the_descriptor_turns_readable_when_the_event_is_set_and_stays_so(stop: Stop) -> None:
    fd = stop.fileno()
    assert not wait_readable([fd], 0.0)
    stop.set()
    assert stop.is_set()
    assert wait_readable([fd], 0.0)
    assert wait_readable([fd], 0.0)  # nothing reads it: every later wait ends at once too


def test_a_descriptor_asked_for_after_the_set_is_readable_at_once(stop: Stop) -> None:
    stop.set()
    assert wait_readable([stop.fileno()], 0.0)


def test_a_set_from_another_thread_ends_a_wait_on_the_descriptor(stop: Stop) -> None:
    fd = stop.fileno()
    setter = threading.Timer(0.05, stop.set)
    setter.start()
    try:
        assert wait_readable([fd], BOUND_S)  # True: the descriptor, not the bound, ended it
    finally:
        setter.join()


def test_each_waker_is_called_once_by_the_thread_that_sets(stop: Stop) -> None:
    calls: list[tuple[str, str]] = []
    stop.on_set(lambda: calls.append(("a", threading.current_thread().name)))
    stop.on_set(lambda: calls.append(("b", threading.current_thread().name)))
    setter = threading.Thread(target=stop.set, name="setter")
    setter.start()
    setter.join()
    stop.set()  # a second set wakes nothing again
    assert calls == [("a", "setter"), ("b", "setter")]


def test_a_waker_registered_after_the_set_is_called_at_once(stop: Stop) -> None:
    stop.set()
    calls: list[str] = []
    stop.on_set(lambda: calls.append("late"))
    assert calls == ["late"]


def test_a_forgotten_waker_is_not_called(stop: Stop) -> None:
    calls: list[str] = []
    forget = stop.on_set(lambda: calls.append("gone"))
    stop.on_set(lambda: calls.append("kept"))
    forget()
    stop.set()
    assert calls == ["kept"]


def test_a_failing_waker_neither_reaches_the_setter_nor_keeps_the_others_asleep(
    stop: Stop,
) -> None:
    calls: list[str] = []

    def broken() -> None:
        raise OSError("its connection is gone")

    stop.on_set(broken)
    stop.on_set(lambda: calls.append("next"))
    fd = stop.fileno()
    stop.set()
    assert calls == ["next"]
    assert wait_readable([fd], 0.0)


def test_a_closed_stop_still_works_as_an_event(stop: Stop) -> None:
    stop.fileno()
    stop.close()
    stop.set()
    assert stop.is_set()
    assert wait_readable([stop.fileno()], 0.0)  # a new pipe, readable as the event is set


def test_a_plain_event_has_no_descriptor_and_wakes_nothing() -> None:
    plain = threading.Event()
    calls: list[str] = []
    forget = on_stop(plain, lambda: calls.append("woken"))
    plain.set()
    forget()
    assert stop_fd(plain) is None
    assert calls == []


def test_stop_fd_and_on_stop_use_a_stops_descriptor_and_wakers(stop: Stop) -> None:
    calls: list[str] = []
    on_stop(stop, lambda: calls.append("woken"))
    assert stop_fd(stop) == stop.fileno()
    stop.set()
    assert calls == ["woken"]


def test_the_worker_loop_wakes_its_broker_when_the_stop_is_set() -> None:
    rig = make_rig()
    stop = Stop()
    rig.broker.on_idle = stop.set  # the first empty take: as a SIGTERM during the wait
    try:
        rig.worker.initialize()
        rig.worker.loop(stop, lambda: None)
        assert rig.broker.wakes == 1
    finally:
        rig.worker.shutdown()
        stop.close()
