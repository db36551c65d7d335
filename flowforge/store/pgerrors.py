"""psycopg's errors translated into FlowForge's, saying truly what went wrong.

Only an outage — the server cannot be reached, refuses connections for now, restarts — is a
:class:`DatabaseUnavailableError` (roles back off, HTTP 503, exit 7). A connection PostgreSQL
refuses for a reason retrying cannot fix (no such database or role, failed authentication, no
``pg_hba.conf`` entry, no privilege) is a :class:`DatabaseConfigError`; a missing table or
column is a :class:`DatabaseNotMigratedError`; a refused value (SQLSTATE class 22, 54) is a
:class:`DatabaseValueError`; a broken constraint (class 23) a :class:`DatabaseConstraintError`;
a deadlock or serialization failure a :class:`TransactionConflictError`; anything else a plain
:class:`StoreError` carrying the server's first line.

libpq gives no SQLSTATE for a failed connection attempt (psycopg's ``OperationalError`` from
``connect`` has ``sqlstate`` None, even for the server's ``FATAL`` 28000), only its message
(``connection to server at "h", port p failed: FATAL:  database "x" does not exist``): those are
classified by the reason, which names the problem in a stable form. TLS failures are refusals
of the configuration too, whether the server said them (``connection requires a valid client
certificate``) or libpq did (``SSL error: certificate verify failed``, ``server certificate for
"h" does not match host name "n"``, ``root certificate file "f" does not exist``, ``private key
file "f" has group or world access``, ``could not load private key file``, ``SSL error: tlsv1
alert unknown ca``); an end of stream in the handshake (``SSL SYSCALL error``, ``SSL error:
unexpected eof``) is not, a restarting server looks the same. When several hosts or addresses
were tried, psycopg lists every attempt: a refusal in any of them makes the whole a
configuration error (the config is wrong for that server, whatever the others did). An
unrecognised reason counts as an outage, so a role keeps retrying rather than giving up on
something that may pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout

from flowforge.errors import (
    DatabaseConfigError,
    DatabaseConstraintError,
    DatabaseNotMigratedError,
    DatabaseUnavailableError,
    DatabaseValueError,
    FlowForgeError,
    StoreError,
    TransactionConflictError,
)

#: ``connection to server at "h" (addr), port p failed: REASON`` or ``... on socket "s" failed``.
_ATTEMPT = re.compile(
    r'connection to server (?:at "(?P<host>[^"]*)"(?: \([^)]*\))?, port (?P<port>\d+)'
    r'|on socket "(?P<socket>[^"]*)") failed: (?P<reason>[^\n]*)'
)
_SEVERITY = re.compile(r"^(?:FATAL|ERROR):\s+")
#: Reasons a server (or libpq) gives when it refuses *this* configuration (retrying cannot
#: help): TLS among them, but not an end of stream during the handshake.
_CONFIG_REASON = re.compile(
    r"does not exist|authentication failed|no password supplied|password is required"
    r"|no pg_hba\.conf entry|permission denied|does not support SSL|certificate|private key"
    r"|SSL error: (?!unexpected eof)|invalid \w+ value|sslrootcert|\bSNI\b",
    re.IGNORECASE,
)
#: What to check for the commonest TLS refusals (the reason itself stays first and whole).
_TLS_HINTS = (
    ("certificate verify failed", "is sslrootcert the CA that signed the server's certificate?"),
    ("requires a valid client certificate", "set sslcert and sslkey in database.url"),
    ("alert unknown ca", "the server does not trust the CA that signed sslcert"),
    ("root certificate file", "sslrootcert must name the CA's certificate file"),
)
#: SQLSTATEs of a connection-level trouble: class 08, 53 (too many clients, disk full, out of
#: memory), 57P01-57P05 (shut down, crashed, starting up, ...).
_OUTAGE_STATES = re.compile(r"^(08|53|57P0\d)")
_NOT_MIGRATED_STATES = frozenset({"42P01", "42703"})  # undefined table, undefined column
_CONFIG_STATES = re.compile(r"^(28|3D000|42501)")  # authorization, no database, no privilege


def check_url(url: str) -> None:
    """Raise :class:`DatabaseConfigError` if libpq cannot parse ``url``, without echoing it.

    libpq's own message quotes the fragment it choked on (``invalid percent-encoded token:
    "hunt%zz"``), which may be part of the password; a pool would log it on every attempt.
    """
    try:
        conninfo_to_dict(url)
    except psycopg.Error as exc:
        reason = re.sub(r'"[^"]*"', '"..."', _first_line(exc))
        raise DatabaseConfigError(
            f"database.url is not a valid PostgreSQL URL or connection string ({reason})"
        ) from None


def translate(exc: BaseException, url: str | None = None) -> FlowForgeError:
    """The FlowForge error that says what ``exc`` (from psycopg) means; ``url`` names the target.

    ``url`` is only used to name the server and the database in the message (never a password).
    """
    state = getattr(exc, "sqlstate", None) or ""
    if isinstance(exc, UnicodeEncodeError):  # a lone surrogate psycopg could not encode
        return DatabaseValueError(f"value refused: a string is not valid Unicode ({exc.reason})")
    # by SQLSTATE class: psycopg's DeadlockDetected and SerializationFailure do not derive from
    # its TransactionRollback (class 40), so an isinstance test misses them
    if state.startswith("40") or isinstance(exc, pg_errors.TransactionRollback):
        return TransactionConflictError(_first_line(exc))
    if state in _NOT_MIGRATED_STATES:
        return DatabaseNotMigratedError(
            f"database {_dbname(url)} is not migrated ({_server_message(exc)}): "
            "run `flowforge migrate`"
        )
    if state.startswith(("22", "54")) or (isinstance(exc, psycopg.DataError) and not state):
        return DatabaseValueError(f"value refused by the database: {_server_message(exc)}")
    if state.startswith("23"):
        return DatabaseConstraintError(f"constraint violated: {_server_message(exc)}")
    if _CONFIG_STATES.match(state):
        return DatabaseConfigError(f"cannot use the database {_dbname(url)}: {_first_line(exc)}")
    if _OUTAGE_STATES.match(state) or (
        not state and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    ):
        return connection_failure(str(exc), url)
    if isinstance(exc, pg_errors.QueryCanceled):
        return StoreError(f"statement cancelled: {_first_line(exc)}")
    return StoreError(f"database error: {_first_line(exc)}")


def connection_failure(message: str, url: str | None = None) -> FlowForgeError:
    """Classify a failed connection (or a connection lost) from libpq's message."""
    text = re.sub(r"^(?:connection failed|connection is bad): ", "", message.strip())
    attempts = [
        (m["socket"] or f"{m['host']}:{m['port']}", _SEVERITY.sub("", m["reason"].strip()))
        for m in _ATTEMPT.finditer(text)
    ]
    if not attempts:
        attempts = [(_target(url), _SEVERITY.sub("", text.splitlines()[0] if text else ""))]
    for where, reason in attempts:
        if _CONFIG_REASON.search(reason):
            at = f" at {where}" if where else ""
            hint = next((h for said, h in _TLS_HINTS if said in reason.lower()), None)
            more = f" ({hint})" if hint else ""
            return DatabaseConfigError(f"cannot use the database{at}: {reason}{more}")
    where, reason = attempts[0]
    lower = reason.lower()
    if "connection refused" in lower:
        said = f"connection refused by {where or 'the server'}"
    elif "timeout expired" in lower:
        said = f"no answer from {where or 'the server'} (connection timeout expired)"
    elif "resolve host" in lower or "translate host name" in lower:
        said = reason
    else:
        said = f"{reason or 'connection lost'}" + (f" ({where})" if where else "")
    return DatabaseUnavailableError(f"database unavailable: {said}")


@contextmanager
def translate_errors(
    url: str | None = None, diagnose: Callable[[], FlowForgeError] | None = None
) -> Iterator[None]:
    """Translate psycopg's errors raised inside the block (see :func:`translate`).

    A pool's :class:`PoolTimeout` hides why it has no connection; ``diagnose`` (the pool's
    owner) finds the real cause.
    """
    try:
        yield
    except PoolTimeout as exc:
        if diagnose is None:
            raise DatabaseUnavailableError(f"database unavailable: {_first_line(exc)}") from exc
        raise diagnose() from exc
    except (psycopg.Error, UnicodeEncodeError) as exc:
        raise translate(exc, url) from exc


def _server_message(exc: BaseException) -> str:
    """The server's primary message and its detail (not the query text, nor its context)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    if not primary:
        return _first_line(exc)
    detail = getattr(diag, "message_detail", None)
    return f"{primary} ({detail.rstrip('.')})" if detail else str(primary)


def _conninfo(url: str | None) -> Mapping[str, object]:
    if not url:
        return {}
    try:
        return conninfo_to_dict(url)
    except psycopg.Error:
        return {}


def _dbname(url: str | None) -> str:
    info = _conninfo(url)
    name = info.get("dbname") or info.get("user")
    return f'"{name}"' if name else "(unnamed)"


def _target(url: str | None) -> str | None:
    """``host:port`` of ``url`` (libpq's defaults filled in), or None without a URL."""
    if not url:
        return None
    info = _conninfo(url)
    host = str(info.get("host") or "localhost")
    return f"{host}:{info.get('port') or 5432}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
