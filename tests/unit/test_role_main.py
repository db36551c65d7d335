"""Running one role in this process (flowforge/roles/main.py), without services.

- SIGTERM and SIGINT become the role's stop event (the real signal, sent to this process);
- the exit code says what happened: 0 after a stop, ``CHILD_RECYCLE`` when the worker asks to
  be replaced, ``CHILD_BOOT_FAILURE`` — at once, without a retry — when the role cannot start
  for a reason a restart will not fix (a queue of the wrong type, a bad config).

What a role does once its stop event is set is in tests/unit/test_worker_delivery.py; the same
through real processes and signals in tests/integration/test_roles_delivery.py (``slow``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import pytest

from flowforge.config import Config, load_config
from flowforge.errors import ConfigError, QueueTypeMismatchError
from flowforge.roles import main
from flowforge.roles.signals import stop_on_signals
from flowforge.telemetry import Telemetry
from supervisor import exitcodes

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


class Probe:
    """A role: ``fail`` raised by initialize; otherwise its loop waits for the stop event
    (``signal_self``: after sending this process SIGTERM, as an operator would)."""

    title = "Probe"

    def __init__(self, fail: Exception | None = None, signal_self: bool = False) -> None:
        self.fail = fail
        self.signal_self = signal_self
        self.recycle = False
        self.initialized = 0
        self.shut = False

    def initialize(self) -> None:
        self.initialized += 1
        if self.fail is not None:
            raise self.fail

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        if self.signal_self:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.wait(SET_WITHIN_S), "SIGTERM did not stop the role"

    def reset(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut = True


def run(role: Probe) -> int:
    config: Config = load_config(env={})
    return main.run("probe", lambda _config, _telemetry: role, config)


def test_a_role_stopped_by_sigterm_exits_clean(caplog: pytest.LogCaptureFixture) -> None:
    role = Probe(signal_self=True)
    with caplog.at_level(logging.INFO):
        assert run(role) == exitcodes.CLEAN
    assert role.shut
    assert "Probe stopped" in caplog.text


def test_a_worker_that_asked_to_be_replaced_exits_to_be_recycled() -> None:
    role = Probe()
    role.recycle = True
    assert run(role) == exitcodes.CHILD_RECYCLE


def test_a_queue_of_the_wrong_type_is_a_boot_failure_with_the_operators_steps_and_no_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = QueueTypeMismatchError(
        "queue 'q' exists with different arguments ... delete it (rabbitmqctl delete_queue q)"
    )
    role = Probe(fail=error)
    assert run(role) == exitcodes.CHILD_BOOT_FAILURE
    assert role.initialized == 1 and role.shut  # not retried, and cleaned up
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith("probe cannot start: ") and "delete_queue q" in line


def test_a_role_that_cannot_be_built_is_a_boot_failure(caplog: pytest.LogCaptureFixture) -> None:
    def refuse(_config: Config, _telemetry: Telemetry) -> Probe:
        raise ConfigError("handlers: no module named 'gone'")

    assert main.run("probe", refuse, load_config(env={})) == exitcodes.CHILD_BOOT_FAILURE
    assert "probe cannot start: handlers: no module named 'gone'" in caplog.text
