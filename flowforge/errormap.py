"""One table: what each FlowForge error means to the command line and to the API.

Every class of the exception tree (flowforge/errors.py, and the few declared beside the code
that raises them) has its own row: an exit code of ``flowforge`` (README, "Exit codes") and an
HTTP status of the API. A lookup walks the class's MRO, so the most specific row wins whatever
the order of the table; tests/unit/test_errormap.py holds every class to a row of its own, so a
new error class is a decision, not an accident.

The two columns agree on the caller's side: what the caller sent is exit 2 / a 4xx, an unknown
id exit 5 / 404, a refusal exit 6 / 409, an outage exit 7 / 503. They differ only where the
operator of the command is not the caller of the API: a refused configuration, a bad workflow
definition or a schema newer than the code is the operator's to fix (exit 2 or 6) but, seen from
an HTTP request, the server's fault: a 500 whose body carries only an error id.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import NamedTuple

from flowforge.broker.messages import MessageError
from flowforge.cli import exitcodes
from flowforge.domain.schedule import ScheduleError
from flowforge.errors import (
    BootError,
    BrokerConfigError,
    BrokerError,
    BrokerUnavailableError,
    ConfigError,
    DatabaseConfigError,
    DatabaseConstraintError,
    DatabaseNotMigratedError,
    DatabaseUnavailableError,
    DatabaseValueError,
    DefinitionError,
    DevServiceError,
    DevServiceMissingError,
    FlowForgeError,
    IllegalTransitionError,
    InputError,
    InvalidIdError,
    MigrationError,
    NotDeadError,
    NotFinishedError,
    NotFoundError,
    QueueTypeMismatchError,
    RequestError,
    ScheduleRetiredError,
    StoreError,
    TransactionConflictError,
    TriggerConflictError,
    UnknownWorkflowError,
    UnstorableValueError,
    UpstreamChangedError,
    ValueTooLargeError,
    WaitTimeoutError,
    WrongStateError,
)


class Meaning(NamedTuple):
    """How one kind of error ends a command (``exit_code``) and an HTTP request (``status``)."""

    exit_code: int
    status: HTTPStatus


_INTERNAL = Meaning(exitcodes.INTERNAL, HTTPStatus.INTERNAL_SERVER_ERROR)
_BAD_INPUT = Meaning(exitcodes.USAGE, HTTPStatus.BAD_REQUEST)
_REFUSED = Meaning(exitcodes.REFUSED, HTTPStatus.CONFLICT)
_OUTAGE = Meaning(exitcodes.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE)
#: the operator's configuration or definitions: exit 2, but no fault of an HTTP caller
_OPERATORS = Meaning(exitcodes.USAGE, HTTPStatus.INTERNAL_SERVER_ERROR)

ERRORS: dict[type[FlowForgeError], Meaning] = {
    FlowForgeError: _INTERNAL,
    # configuration and definitions
    ConfigError: _OPERATORS,
    DefinitionError: _OPERATORS,
    ScheduleError: _OPERATORS,
    # domain: a caller bug, caught before any SQL ran
    IllegalTransitionError: _INTERNAL,
    # operator-facing lookups and requests
    RequestError: _INTERNAL,  # only its subclasses are raised
    InvalidIdError: _BAD_INPUT,
    InputError: _BAD_INPUT,
    UnstorableValueError: _BAD_INPUT,
    ValueTooLargeError: _BAD_INPUT,
    UnknownWorkflowError: Meaning(exitcodes.USAGE, HTTPStatus.UNPROCESSABLE_ENTITY),
    NotFoundError: Meaning(exitcodes.NOT_FOUND, HTTPStatus.NOT_FOUND),
    NotDeadError: _REFUSED,
    NotFinishedError: _REFUSED,
    TriggerConflictError: _REFUSED,
    ScheduleRetiredError: _REFUSED,
    WrongStateError: _REFUSED,
    # storage
    StoreError: _INTERNAL,
    DatabaseUnavailableError: _OUTAGE,
    TransactionConflictError: _INTERNAL,  # only after Database.run retried it: contention
    MigrationError: Meaning(exitcodes.REFUSED, HTTPStatus.INTERNAL_SERVER_ERROR),
    DatabaseConfigError: _OPERATORS,
    DatabaseNotMigratedError: _OPERATORS,
    DatabaseValueError: _BAD_INPUT,
    DatabaseConstraintError: _REFUSED,
    UpstreamChangedError: _INTERNAL,  # raised in a handler (its attempt fails), never in a reply
    # broker
    BrokerError: _INTERNAL,
    BrokerUnavailableError: _OUTAGE,
    BrokerConfigError: _OPERATORS,
    QueueTypeMismatchError: _INTERNAL,
    MessageError: _INTERNAL,
    # roles
    BootError: _INTERNAL,
    # waiting: the run goes on; the api never waits (docs/testing-workflows.md), so the status
    # is only the row's other column
    WaitTimeoutError: Meaning(exitcodes.WAIT_TIMEOUT, HTTPStatus.GATEWAY_TIMEOUT),
    # flowforge dev's private services (never met by the API)
    DevServiceError: Meaning(exitcodes.SERVICE_FAILED, HTTPStatus.INTERNAL_SERVER_ERROR),
    DevServiceMissingError: Meaning(exitcodes.SERVICE_MISSING, HTTPStatus.INTERNAL_SERVER_ERROR),
}


def meaning(exc: BaseException) -> Meaning:
    """The row of the most specific class of ``exc`` (an internal error for a foreign one)."""
    for kind in type(exc).__mro__:
        found = ERRORS.get(kind)
        if found is not None:
            return found
    return _INTERNAL


def exit_code_for(exc: BaseException) -> int:
    """The exit code of ``flowforge`` for ``exc`` (README, "Exit codes")."""
    return meaning(exc).exit_code


def http_status_for(exc: BaseException) -> HTTPStatus:
    """The API's status for ``exc``: a 4xx for what the caller sent, 503 for an outage, else
    500."""
    return meaning(exc).status
