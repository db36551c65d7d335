"""The exception tree of FlowForge.

One root, :class:`FlowForgeError`, with a subtree per layer. Third-party errors (psycopg, pika)
are translated at the boundary that meets them with ``raise Ours(...) from exc`` so callers only
ever catch FlowForge's own types.

:class:`PermanentError` is different in kind: it is raised *by handlers* to say "do not retry",
so it is not part of the engine's tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every layer imports this module: it imports none, but names this type
    from flowforge.domain.model import Run


class PermanentError(Exception):
    """Raised by a handler to fail its task without any further retry."""


class FlowForgeError(Exception):
    """Root of every error FlowForge itself raises."""


# --- configuration and definitions -------------------------------------------------------------


class ConfigError(FlowForgeError):
    """The configuration file or an override is invalid; the message names the key path."""


class DefinitionError(FlowForgeError):
    """A workflow definition is invalid (unknown dependency, cycle, duplicate name, ...)."""


# --- domain ------------------------------------------------------------------------------------


class IllegalTransitionError(FlowForgeError):
    """A caller asked for a state change the state machine does not allow.

    Raised before any SQL runs, so a caller bug is never mistaken for a lost race.
    """


# --- operator-facing lookups and requests ------------------------------------------------------


class RequestError(FlowForgeError):
    """An operator or API request cannot be honoured as asked."""


class InvalidIdError(RequestError):
    """An id is not a well-formed UUID."""


class NotFoundError(RequestError):
    """No run or task run has the given id."""


class UnknownWorkflowError(RequestError):
    """No workflow of that name is defined."""


class InputError(RequestError):
    """A run input is not acceptable (not an object, or a key template cannot be formatted)."""


class TriggerConflictError(RequestError):
    """A trigger idempotency key was reused with a different workflow or input."""


class NotDeadError(RequestError):
    """A requeue was asked for a task run that is not DEAD."""


class NotFinishedError(RequestError):
    """A rerun was asked for a run that is not finished (or has nothing to run again)."""


class WrongStateError(RequestError):
    """An operator's action on one task (cancel, retry-now, bury) that its state refuses; the
    message names the state. Nothing was changed or audited."""


class ScheduleRetiredError(RequestError):
    """The schedule is retired (its workflow file no longer defines it): nothing to act on."""


class UnstorableValueError(InputError):
    """A value PostgreSQL cannot store as given (NaN, ±Infinity, a NUL character, a lone
    surrogate, nesting or size over a bound, a non-JSON type). The message says what and where
    (a JSON path such as ``$.items[3].name``). Raised before any SQL runs."""


class ValueTooLargeError(UnstorableValueError):
    """An otherwise storable value whose encoded size is over its bound."""


class WaitTimeoutError(FlowForgeError):
    """``Client.wait`` gave up: the run was not finished within the timeout. ``run`` is the
    last state read (None only when raised without one). Not a refusal: the run goes on, and a
    later wait may see it finish (``flowforge status --wait``: exit 10)."""

    def __init__(self, message: str, run: Run | None = None) -> None:
        super().__init__(message)
        self.run = run


# --- storage -----------------------------------------------------------------------------------


class StoreError(FlowForgeError):
    """PostgreSQL could not do what was asked."""


class DatabaseUnavailableError(StoreError):
    """A connection-level failure: the database is down, restarting or unreachable.

    Transient by nature: roles back off and retry.
    """


class TransactionConflictError(StoreError):
    """A deadlock or serialization failure: the transaction may be run again as is.

    ``Database.run`` / ``Database.execute`` do so; raised only once they have given up.
    """


class MigrationError(StoreError):
    """The schema cannot be brought to the expected version."""


class DatabaseConfigError(ConfigError):
    """PostgreSQL refuses this configuration: no such database or role, authentication failed,
    no access, or the schema is not migrated. Not an outage — retrying cannot fix it: exit 2
    from the CLI, and a role that meets it before it ever started fails to boot (exit 3).
    """


class DatabaseNotMigratedError(DatabaseConfigError):
    """FlowForge's tables (or this version's columns) are missing: run ``flowforge migrate``."""


class DatabaseValueError(StoreError):
    """PostgreSQL refused a value (SQLSTATE class 22 data exception, 54 too large): the caller's
    input, so an HTTP 400 / exit 2 — never "unavailable"."""


class DatabaseConstraintError(StoreError):
    """A statement broke an integrity constraint (SQLSTATE class 23): HTTP 409 / exit 6."""


class UpstreamChangedError(StoreError):
    """A page of an upstream result (``ctx.upstream``'s lazy form, issue 22) did not match what
    the claim counted: the upstream was rerun or its run purged while the handler read it. The
    handler's attempt fails (handler_error) and is retried as any other."""


# --- broker ------------------------------------------------------------------------------------


class BrokerError(FlowForgeError):
    """RabbitMQ could not do what was asked."""


class BrokerUnavailableError(BrokerError):
    """A connection-level failure: the broker is down, restarting or unreachable (transient)."""


class BrokerConfigError(ConfigError):
    """RabbitMQ refuses this configuration for a reason retrying cannot fix: a TLS failure (the
    broker's certificate not signed by ``broker.tls.ca_file``, not valid for the URL's host,
    this client's certificate missing or refused) or a certificate file that cannot be read.
    Like :class:`DatabaseConfigError`: exit 2 from the CLI, a role that meets it before it ever
    started fails to boot (exit 3).
    """


class QueueTypeMismatchError(BrokerError):
    """The task queue exists with another type than quorum. An operator must fix it; not retried."""


# --- roles ---------------------------------------------------------------------------------------


class BootError(FlowForgeError):
    """A role cannot start for a reason that retrying will not fix (config, imports, topology)."""


# --- flowforge dev ------------------------------------------------------------------------------


class DevServiceError(FlowForgeError):
    """A private PostgreSQL or RabbitMQ of ``flowforge dev`` (flowforge/devservices) could not be
    started, stopped or inspected: a port taken, a server that did not come up in time."""


class DevServiceMissingError(DevServiceError):
    """A binary or system account a private service needs is not on this machine; the message
    names the Debian package that provides it."""


#: Outages: what a role survives by reconnecting with backoff (``run_role``), and what the
#: worker's finish is retried through. A :class:`TransactionConflictError` is not one: the
#: ``Database`` already ran the transaction again, and is the only level that does
#: (``flowforge/roles/runner.py``, "Who retries a failed statement").
TRANSIENT_ERRORS: tuple[type[FlowForgeError], ...] = (
    DatabaseUnavailableError,
    BrokerUnavailableError,
)
