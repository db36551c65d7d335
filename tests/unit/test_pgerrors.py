"""Database errors said truly: psycopg's real exception classes through ``translate``.

The connection messages are libpq's own (copied from real failures against PostgreSQL 15 and
libpq 17); query-time errors are psycopg's SQLSTATE classes. Only an outage may become a
DatabaseUnavailableError; the caller's value is a DatabaseValueError; a refused configuration
is a DatabaseConfigError (a ConfigError: exit 2, a boot failure).
"""

from __future__ import annotations

import logging
import re

import falcon
import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from flowforge.api.errors import handle_flowforge_error
from flowforge.cli import exitcodes
from flowforge.cli.main import exit_code_for
from flowforge.errormap import http_status_for
from flowforge.errors import (
    ConfigError,
    DatabaseConfigError,
    DatabaseConstraintError,
    DatabaseNotMigratedError,
    DatabaseUnavailableError,
    DatabaseValueError,
    FlowForgeError,
    StoreError,
    TransactionConflictError,
)
from flowforge.store.pgerrors import check_url, translate, translate_errors

URL = "postgresql://ff:s3cret@db.example:5433/orders"
AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '


def op(message: str) -> psycopg.OperationalError:
    return psycopg.OperationalError(message)


@pytest.mark.parametrize(
    ("message", "kind", "said"),
    [
        (
            AT + 'FATAL:  database "nosuch" does not exist',
            DatabaseConfigError,
            'cannot use the database at 127.0.0.1:5432: database "nosuch" does not exist',
        ),
        (
            AT + 'FATAL:  password authentication failed for user "ff"',
            DatabaseConfigError,
            "cannot use the database at 127.0.0.1:5432: "
            'password authentication failed for user "ff"',
        ),
        (
            AT + 'FATAL:  role "ghost" does not exist',
            DatabaseConfigError,
            'cannot use the database at 127.0.0.1:5432: role "ghost" does not exist',
        ),
        (AT + "fe_sendauth: no password supplied", DatabaseConfigError, "no password supplied"),
        (
            AT + 'FATAL:  no pg_hba.conf entry for host "10.1.1.1", user "ff", database "x", '
            "no encryption",
            DatabaseConfigError,
            "no pg_hba.conf entry",
        ),
        (
            AT + "server does not support SSL, but SSL was required",
            DatabaseConfigError,
            "SSL was required",
        ),
        (
            'connection failed: connection to server at "127.0.0.1", port 5999 failed: '
            "Connection refused\n\tIs the server running on that host and accepting TCP/IP "
            "connections?",
            DatabaseUnavailableError,
            "database unavailable: connection refused by 127.0.0.1:5999",
        ),
        (
            "connection timeout expired",
            DatabaseUnavailableError,
            "database unavailable: no answer from db.example:5433 (connection timeout expired)",
        ),
        (
            "failed to resolve host 'nosuch.invalid': [Errno -2] Name or service not known",
            DatabaseUnavailableError,
            "database unavailable: failed to resolve host 'nosuch.invalid'",
        ),
        (
            AT + "FATAL:  the database system is starting up",
            DatabaseUnavailableError,
            "database unavailable: the database system is starting up (127.0.0.1:5432)",
        ),
        (
            AT + "FATAL:  sorry, too many clients already",
            DatabaseUnavailableError,
            "too many clients",
        ),
        (
            'connection is bad: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '
            "No such file or directory",
            DatabaseUnavailableError,
            "No such file or directory (/run/pg/.s.PGSQL.5432)",
        ),
        (
            "consuming input failed: server closed the connection unexpectedly",
            DatabaseUnavailableError,
            "server closed the connection unexpectedly",
        ),
    ],
)
def test_a_failed_connection_says_which(
    message: str, kind: type[FlowForgeError], said: str
) -> None:
    error = translate(op(message), URL)
    assert type(error) is kind
    assert said in str(error)
    assert "s3cret" not in str(error)


def test_a_refused_configuration_is_a_config_error_and_exits_2() -> None:
    error = translate(op(AT + 'FATAL:  database "x" does not exist'), URL)
    assert isinstance(error, ConfigError)
    assert exit_code_for(error) == exitcodes.USAGE
    assert exit_code_for(translate(op("connection timeout expired"))) == exitcodes.UNAVAILABLE


@pytest.mark.parametrize(
    ("exc", "kind", "fragment"),
    [
        (
            pg_errors.UndefinedTable('relation "workflow_runs" does not exist'),
            DatabaseNotMigratedError,
            'database "orders" is not migrated',
        ),
        (
            pg_errors.UndefinedColumn('column "deadline" does not exist'),
            DatabaseNotMigratedError,
            "run `flowforge migrate`",
        ),
        (
            pg_errors.InvalidTextRepresentation("invalid input syntax for type json"),
            DatabaseValueError,
            "value refused by the database: invalid input syntax for type json",
        ),
        (
            pg_errors.UntranslatableCharacter("unsupported Unicode escape sequence"),
            DatabaseValueError,
            "unsupported Unicode escape sequence",
        ),
        (
            pg_errors.NumericValueOutOfRange("integer out of range"),
            DatabaseValueError,
            "integer out of range",
        ),
        (
            pg_errors.ProgramLimitExceeded(
                "total size of jsonb array elements exceeds the maximum"
            ),
            DatabaseValueError,
            "exceeds the maximum",
        ),
        (
            psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
            DatabaseValueError,
            "NUL",
        ),
        (
            pg_errors.UniqueViolation("duplicate key value violates unique constraint"),
            DatabaseConstraintError,
            "constraint violated: duplicate key",
        ),
        (
            pg_errors.ForeignKeyViolation("insert or update violates foreign key constraint"),
            DatabaseConstraintError,
            "foreign key",
        ),
        (pg_errors.DeadlockDetected("deadlock detected"), TransactionConflictError, "deadlock"),
        (pg_errors.SerializationFailure("could not serialize"), TransactionConflictError, "serial"),
        (
            pg_errors.InsufficientPrivilege("permission denied for table task_runs"),
            DatabaseConfigError,
            "permission denied for table task_runs",
        ),
        (
            pg_errors.AdminShutdown("terminating connection due to administrator command"),
            DatabaseUnavailableError,
            "database unavailable: terminating connection",
        ),
        (
            pg_errors.CannotConnectNow("the database system is starting up"),
            DatabaseUnavailableError,
            "starting up",
        ),
        (pg_errors.DiskFull("could not extend file"), DatabaseUnavailableError, "could not extend"),
        (
            pg_errors.QueryCanceled("canceling statement due to statement timeout"),
            StoreError,
            "statement cancelled: canceling statement due to statement timeout",
        ),
        (pg_errors.SyntaxError('syntax error at or near "SELEC"'), StoreError, "database error"),
        (psycopg.InterfaceError("the connection is closed"), DatabaseUnavailableError, "closed"),
    ],
)
def test_a_query_error_is_classified_by_its_sqlstate(
    exc: BaseException, kind: type[FlowForgeError], fragment: str
) -> None:
    error = translate(exc, URL)
    assert type(error) is kind, (type(error), error)
    assert fragment in str(error)


def test_a_lone_surrogate_psycopg_cannot_encode_is_a_refused_value() -> None:
    try:
        "\ud800".encode()
    except UnicodeEncodeError as exc:
        error = translate(exc)
    assert isinstance(error, DatabaseValueError) and "not valid Unicode" in str(error)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (
            pg_errors.InvalidTextRepresentation("invalid input syntax for type json"),
            "400 Bad Request",
        ),
        (pg_errors.UniqueViolation("duplicate key"), "409 Conflict"),
        (op("connection timeout expired"), "503 Service Unavailable"),
    ],
)
def test_the_api_maps_only_an_outage_to_503(exc: BaseException, status: str) -> None:
    error = translate(exc)
    assert falcon.code_to_http_status(http_status_for(error)) == status


@pytest.mark.parametrize(
    "exc",
    [
        pg_errors.SyntaxError("syntax error"),
        pg_errors.QueryCanceled("canceling statement due to statement timeout"),
        pg_errors.UndefinedTable('relation "x" does not exist'),
        op(AT + 'FATAL:  password authentication failed for user "ff"'),
    ],
)
def test_no_error_that_is_not_an_outage_gets_a_503(exc: BaseException) -> None:
    error = translate(exc)
    assert http_status_for(error) != 503, error


def test_a_pool_timeout_is_explained_by_the_diagnosis() -> None:
    cause = translate(op(AT + 'FATAL:  database "x" does not exist'))
    with pytest.raises(DatabaseConfigError) as raised, translate_errors(URL, lambda: cause):
        raise PoolTimeout("couldn't get a connection after 5.00 sec")
    assert raised.value is cause
    with (
        pytest.raises(DatabaseUnavailableError, match="couldn't get a connection"),
        translate_errors(URL),
    ):
        raise PoolTimeout("couldn't get a connection after 5.00 sec")


@pytest.mark.parametrize(
    "url",
    ["postgresql://ff:hunt%zz@db/x", "host=db password=hunt er2", "host=db password='hunter2"],
)
def test_a_malformed_url_is_refused_without_echoing_any_of_it(url: str) -> None:
    # libpq's own message quotes the fragment it choked on: part of the password here
    with pytest.raises(DatabaseConfigError, match="not a valid PostgreSQL URL") as raised:
        check_url(url)
    assert "hunt" not in str(raised.value) and raised.value.__cause__ is None
    check_url("postgresql://ff:hunt%41@db:5432/x?sslmode=require")  # control: a valid one


def test_any_other_database_error_is_a_500_whose_id_is_logged_with_the_detail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = translate(pg_errors.SyntaxError('syntax error at or near "SELEC"'))
    with (
        caplog.at_level(logging.ERROR, logger="flowforge.api.errors"),
        pytest.raises(falcon.HTTPError) as raised,
    ):
        handle_flowforge_error(None, None, error, None)  # type: ignore[arg-type]
    assert raised.value.status == falcon.HTTP_500
    found = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\)", str(raised.value.title))
    assert found, raised.value.title
    (record,) = [r for r in caplog.records if found[1] in r.getMessage()]
    assert 'syntax error at or near "SELEC"' in record.getMessage() and record.exc_info


def test_without_a_url_no_server_is_made_up() -> None:
    error = translate(op("consuming input failed: server closed the connection unexpectedly"))
    assert str(error) == (
        "database unavailable: consuming input failed: server closed the connection unexpectedly"
    )
    assert str(translate(op("connection timeout expired"))) == (
        "database unavailable: no answer from the server (connection timeout expired)"
    )
