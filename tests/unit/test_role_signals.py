"""A role's SIGTERM/SIGINT become its stop event (flowforge/roles/signals.py), in-process.

The real signal is sent to this process while :func:`stop_on_signals` is in force; what a role
does once its stop event is set is proven in tests/unit/test_worker_delivery.py (and with real
processes in tests/integration/test_roles_delivery.py, marked ``slow``).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from flowforge.roles.signals import stop_on_signals

#: A bound on the watcher thread's reaction, not a sleep.
SET_WITHIN_S = 5.0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_sets_the_stop_event_and_the_old_handler_comes_back(signum: int) -> None:
    before = signal.getsignal(signum)
    stop = threading.Event()
    with stop_on_signals(stop):
        assert not stop.is_set()
        os.kill(os.getpid(), signum)
        assert stop.wait(SET_WITHIN_S), "the signal did not reach the stop event"
    assert signal.getsignal(signum) == before
