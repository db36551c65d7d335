"""A role's stop ends its blocking wait at once, through the real servers it waits on.

Each role waits between passes: the worker in pika's consumer for a delivery, the scheduler on
its LISTEN connection, the publisher in pika's I/O loop for a NOTIFY, the api in waitress's
event loop. Here each wait is made far longer than the test's bound (the poll interval, the
worker's idle wait, the api's slice at 120 s), the role's loop runs on a thread with a
:class:`~flowforge.roles.stopping.Stop`, and the stop must end it within the bound: only the
wake can. (Before the wake, a SIGTERM'd child noticed its stop at its next poll: about a
second per tree stop; docs/development.md.) That the role then drains as before is proven by
the drain tests (tests/integration/test_roles_delivery.py, tests/chaos/test_supervisor.py).
"""

from __future__ import annotations

import threading
import time

import pytest

import flowforge.api.server
import flowforge.roles.worker
from flowforge.api.server import ApiServer
from flowforge.broker.consume import Consumer
from flowforge.config import Config, load_config
from flowforge.roles.publisher import Publisher
from flowforge.roles.runner import Role
from flowforge.roles.scheduler import Scheduler
from flowforge.roles.stopping import Stop
from flowforge.roles.worker import Worker
from tests.e2e import Stack

pytestmark = pytest.mark.integration

#: Every wait here would last this long without the wake (seconds).
LONG_WAIT_S = 120.0
#: A bound on a woken wait: far below LONG_WAIT_S, far above a wake on a loaded machine.
BOUND_S = 30.0


def config(stack: Stack, **overrides: object) -> Config:
    return load_config(
        stack.config_path(scheduler={"poll_interval_s": LONG_WAIT_S}, **overrides), env={}
    )


def stops_within_bound(role: Role) -> None:
    """Run ``role``'s loop on a thread, let it reach its wait, set the stop: the loop must
    return within BOUND_S although its wait lasts LONG_WAIT_S."""
    stop = Stop()
    role.initialize()
    try:
        thread = threading.Thread(target=role.loop, args=(stop, lambda: None), daemon=True)
        thread.start()
        thread.join(0.3)  # most likely in its wait by now; a stop before the wait ends it too
        assert thread.is_alive(), "the loop returned before its stop"
        stop.set()
        thread.join(BOUND_S)
        assert not thread.is_alive(), f"the stop did not end {role.title}'s wait"
    finally:
        role.shutdown()
        stop.close()


def test_a_stop_ends_the_consumers_take_at_once(stack: Stack) -> None:
    consumer = Consumer(config(stack).broker)
    consumer.connect()
    stop = Stop()
    stop.on_set(consumer.wake)
    setter = threading.Timer(0.2, stop.set)
    try:
        started = time.monotonic()
        setter.start()
        assert consumer.take(1, LONG_WAIT_S) == []
        assert time.monotonic() - started < BOUND_S, "the wake did not end the take"
    finally:
        setter.join()
        consumer.close()
        stop.close()


def test_a_stop_ends_the_workers_wait_for_a_delivery(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flowforge.roles.worker, "IDLE_WAIT_S", LONG_WAIT_S)
    stops_within_bound(Worker(config(stack), handlers={}))


def test_a_stop_ends_the_schedulers_wait_for_a_notify(stack: Stack) -> None:
    stops_within_bound(Scheduler(config(stack)))


def test_a_stop_ends_the_publishers_idle_wait(stack: Stack) -> None:
    stops_within_bound(Publisher(config(stack)))


def test_a_stop_ends_the_apis_event_loop_slice(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flowforge.api.server, "SLICE_S", LONG_WAIT_S)
    stops_within_bound(ApiServer(config(stack, api={"listen": "127.0.0.1:0"})))
