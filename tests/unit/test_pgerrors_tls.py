"""A TLS failure connecting to PostgreSQL is a refused configuration, said in one line.

The messages are libpq's own (bundled libpq 18 with OpenSSL 3, against PostgreSQL 15 with
``hostssl … cert``), copied from real failures (tests/integration/test_tls.py makes them). psycopg
gives no SQLSTATE for a failed connection, so the reason is read: a refusal is a
DatabaseConfigError (exit 2, a role's boot failure), never an outage (exit 7, retried forever).
"""

from __future__ import annotations

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.errormap import exit_code_for
from flowforge.errors import DatabaseConfigError, DatabaseUnavailableError
from flowforge.store.pgerrors import translate

AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
WHERE = "cannot use the database at 127.0.0.1:5432: "


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (
            "SSL error: certificate verify failed",
            "SSL error: certificate verify failed "
            "(is sslrootcert the CA that signed the server's certificate?)",
        ),
        (
            'server certificate for "127.0.0.1" does not match host name "localhost"',
            'server certificate for "127.0.0.1" does not match host name "localhost"',
        ),
        (
            "FATAL:  connection requires a valid client certificate",
            "connection requires a valid client certificate (set sslcert and sslkey in "
            "database.url)",
        ),
        (
            'root certificate file "/root/.postgresql/root.crt" does not exist\nEither provide '
            "the file, use the system's trusted roots with sslrootcert=system, or change sslmode "
            "to disable server certificate verification.",
            'root certificate file "/root/.postgresql/root.crt" does not exist '
            "(sslrootcert must name the CA's certificate file)",
        ),
        (
            'private key file "/etc/ff/client.key" has group or world access; file must have '
            "permissions u=rw (0600) or less if owned by the current user, or permissions "
            "u=rw,g=r (0640) or less if owned by root",
            'private key file "/etc/ff/client.key" has group or world access',
        ),
        (
            'could not load private key file "/etc/ff/client.key": key values mismatch',
            'could not load private key file "/etc/ff/client.key": key values mismatch',
        ),
        (
            "SSL error: tlsv1 alert unknown ca",
            "SSL error: tlsv1 alert unknown ca "
            "(the server does not trust the CA that signed sslcert)",
        ),
        (
            "SSL error: sslv3 alert bad certificate",
            "SSL error: sslv3 alert bad certificate",
        ),
        (
            "server does not support SSL, but SSL was required",
            "server does not support SSL, but SSL was required",
        ),
    ],
)
def test_a_tls_failure_is_a_refused_configuration(reason: str, said: str) -> None:
    error = translate(psycopg.OperationalError(AT + reason))
    assert isinstance(error, DatabaseConfigError), error
    assert str(error).startswith(WHERE + said), str(error)
    assert "\n" not in str(error)
    assert exit_code_for(error) == exitcodes.USAGE


@pytest.mark.parametrize(
    "reason",
    [
        "SSL SYSCALL error: EOF detected",
        "SSL error: unexpected eof while reading",
        "server closed the connection unexpectedly\n\tThis probably means the server terminated "
        "abnormally\n\tbefore or while processing the request.",
    ],
)
def test_an_end_of_stream_in_the_handshake_is_an_outage(reason: str) -> None:
    error = translate(psycopg.OperationalError(AT + reason))
    assert isinstance(error, DatabaseUnavailableError), error
    assert exit_code_for(error) == exitcodes.UNAVAILABLE


def test_a_refusal_by_any_of_several_hosts_is_a_refused_configuration() -> None:
    """psycopg tries each host (and address) and lists every failure; the first line is the
    last attempt's. A host that refuses TLS makes the config wrong whatever the others did."""
    message = (
        'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection '
        "refused\n\tIs the server running on that host and accepting TCP/IP connections?\n"
        "Multiple connection attempts failed. All failures were:\n"
        "- host: 'db-1', port: '5432', hostaddr: '10.0.0.1': connection failed: connection to "
        'server at "10.0.0.1", port 5432 failed: SSL error: certificate verify failed\n'
        "- host: 'db-2', port: '1', hostaddr: '127.0.0.1': connection failed: connection to "
        'server at "127.0.0.1", port 1 failed: Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?"
    )
    error = translate(psycopg.OperationalError(message))
    assert isinstance(error, DatabaseConfigError), error
    assert str(error).startswith(
        "cannot use the database at 10.0.0.1:5432: SSL error: certificate verify failed"
    )


def test_hosts_that_are_all_down_are_an_outage() -> None:
    message = (
        'connection failed: connection to server at "127.0.0.1", port 2 failed: Connection '
        "refused\nMultiple connection attempts failed. All failures were:\n"
        "- host: 'a', port: '1', hostaddr: '127.0.0.1': connection failed: connection to "
        'server at "127.0.0.1", port 1 failed: Connection refused\n'
        "- host: 'b', port: '2', hostaddr: '127.0.0.1': connection failed: connection to "
        'server at "127.0.0.1", port 2 failed: Connection refused'
    )
    error = translate(psycopg.OperationalError(message))
    assert isinstance(error, DatabaseUnavailableError)
    assert str(error) == "database unavailable: connection refused by 127.0.0.1:2"
