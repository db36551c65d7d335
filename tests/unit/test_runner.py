"""``run_role`` and a database that refuses the configuration: fail the boot, or, once the role
has run, log an error on every attempt and keep retrying (the server changed, not the config)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest

from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.errors import BrokerConfigError, DatabaseConfigError, DatabaseNotMigratedError
from flowforge.roles.runner import run_role

NO_WAIT = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)


class Refusing:
    """A role whose initialize fails as ``plan`` says (None: succeeds), then whose loop stops."""

    title = "Probe"

    def __init__(self, plan: list[Exception | None]) -> None:
        self.plan = plan
        self.initialized = 0
        self.resets = 0
        self.shut = False

    def initialize(self) -> None:
        self.initialized += 1
        step = self.plan.pop(0)
        if step is not None:
            raise step

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        if self.plan:  # fail once more, from the loop, as a lost database would
            step = self.plan.pop(0)
            if step is not None:
                raise step
        stop.set()

    def reset(self) -> None:
        self.resets += 1

    def shutdown(self) -> None:
        self.shut = True


def test_a_refused_configuration_before_the_first_start_fails_the_boot() -> None:
    role = Refusing([DatabaseNotMigratedError('database "x" is not migrated')])
    with pytest.raises(DatabaseNotMigratedError):
        run_role(role, threading.Event(), backoff=NO_WAIT)
    assert role.initialized == 1 and role.shut


def test_a_broker_refusing_tls_before_the_first_start_fails_the_boot() -> None:
    refused = BrokerConfigError("cannot use the broker at mq:5671: TLS: ...")
    role = Refusing([refused])
    with pytest.raises(BrokerConfigError):
        run_role(role, threading.Event(), backoff=NO_WAIT)
    assert role.initialized == 1 and role.shut and role.resets == 0


def test_once_started_a_broker_refusing_tls_is_logged_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A certificate rotated wrongly on a running cluster: an error each time, not a boot
    failure; the role resumes once the broker takes it again."""
    refused = BrokerConfigError("cannot use the broker at mq:5671: TLS: certificate refused")
    role = Refusing([None, refused, refused, None, None])
    with caplog.at_level(logging.INFO, logger="flowforge.roles.runner"):
        run_role(role, threading.Event(), backoff=NO_WAIT)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(" (")[0] for r in errors] == ["Probe cannot use the broker"] * 2
    assert all(getattr(r, "action", None) == "broker_refused" for r in errors)
    assert role.resets == 2 and role.initialized == 3


def test_once_started_a_refused_configuration_is_logged_each_time_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = DatabaseConfigError('password authentication failed for user "ff"')
    role = Refusing([None, refused, refused, refused, None, None])
    with caplog.at_level(logging.INFO, logger="flowforge.roles.runner"):
        run_role(role, threading.Event(), backoff=NO_WAIT)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3
    assert all("cannot use the database" in r.getMessage() for r in errors)
    assert all("password authentication failed" in r.getMessage() for r in errors)
    assert any("recovered" in r.getMessage() for r in caplog.records)
    assert role.resets == 3 and role.initialized == 4
