"""TLS to RabbitMQ: the SSL context ``broker.tls`` describes, the server name each node's
certificate must match, and which failed connection attempts are TLS refusals.

Every ``amqps://`` node gets one :class:`ssl.SSLContext` (``CERT_REQUIRED``, ``check_hostname``;
the CA of ``broker.tls.ca_file``, else the system's) with this client's certificate, and the
host of its own URL as the server name (SNI and the name its certificate must be valid for).
The files are read at every connection attempt, so replaced certificates are used from the next
reconnect on.

A failure that retrying cannot fix is a :class:`BrokerConfigError` (exit 2 from the CLI; a role
that meets it at boot stops ``flowforge up`` with exit 3), not an outage:

- a file of ``broker.tls`` that cannot be read or used (missing, not PEM, a key that does not
  match its certificate, an encrypted key);
- the broker's certificate refused here (:class:`ssl.SSLCertVerificationError`: not signed by
  the CA, not valid for the URL's host, expired), or any other handshake error OpenSSL reports
  (:class:`ssl.SSLError`: the broker's alert that it refused this client's certificate, a port
  that does not speak TLS);
- the broker closing the TLS connection right after the handshake, before the AMQP one: how a
  TLS 1.3 server refuses a missing or untrusted client certificate. pika keeps only the text of
  that error (``IncompatibleProtocolError`` carrying ``SSLEOFError`` or the alert), so it is
  recognised by that text.

An end of stream *during* the handshake (``SSLEOFError``, ``SSLZeroReturnError``,
``SSLSyscallError``) stays an outage: a broker that stops or restarts looks the same.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator, Sequence

import pika
import pika.exceptions

from flowforge.config import BrokerTlsConfig
from flowforge.errors import BrokerConfigError, BrokerError, BrokerUnavailableError

#: ssl errors that mean the stream ended, not that TLS refused anything.
_STREAM_ENDED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
#: ``[SSL: CODE] reason`` inside the text pika keeps of a lost stream.
_SSL_TEXT = re.compile(r"\[SSL: (?P<code>[A-Z0-9_]+)\] (?P<reason>[^(\"'\\]+?)\s*(?:\(|$|[\"'\\])")
#: ``[SSL: CODE] `` before OpenSSL's reason and `` (_ssl.c:1006)`` after it.
_SSL_NOISE = re.compile(r"^\[[A-Z0-9]+(?:: [A-Z0-9_]+)?\]\s*|\s*\(_ssl\.c:\d+\)$")
_EOF_TEXT = re.compile(r"SSLEOFError|SSLZeroReturnError|EOF occurred in violation of protocol")
_NOT_VERIFIED = "is broker.tls.ca_file the CA that signed the broker's certificate?"
_NAME_HINT = "the host of each broker.url must be a name or address in that node's certificate"


class _EncryptedKey(Exception):
    """Raised by the password callback: FlowForge takes unencrypted keys only (no prompt)."""


def context(tls: BrokerTlsConfig | None) -> ssl.SSLContext:
    """A client context that verifies the broker (its CA, its name) and presents this client's
    certificate; raises :class:`BrokerConfigError` naming the key of a file it cannot use."""
    tls = tls or BrokerTlsConfig()
    try:
        # with a cafile, only that file is trusted; without, the system's CAs
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise BrokerConfigError(
            f"broker.tls.ca_file: cannot use {tls.ca_file}: {_reason(exc)}"
        ) from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    if tls.cert_file is not None:
        what = "broker.tls.cert_file" + (" / key_file" if tls.key_file else "")
        files = tls.cert_file + (f", {tls.key_file}" if tls.key_file else "")
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
        except _EncryptedKey:
            raise BrokerConfigError(
                f"{what}: the key in {files} is encrypted; FlowForge needs an unencrypted key "
                "readable by its user only (mode 0600)"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise BrokerConfigError(f"{what}: cannot use {files}: {_reason(exc)}") from None
    return ctx


def _no_password() -> bytes:
    """OpenSSL would otherwise prompt on the terminal for an encrypted key's passphrase."""
    raise _EncryptedKey


def connect_error(
    failures: Sequence[tuple[str, BaseException]],
) -> BrokerConfigError | BrokerUnavailableError:
    """The error of a connect that reached no node; ``failures`` are ``(host:port, error)``.

    A TLS refusal by any node is a :class:`BrokerConfigError` naming that node (the config is
    wrong for it, whatever the other nodes did); otherwise a :class:`BrokerUnavailableError`
    naming every node's failure.
    """
    for where, exc in failures:
        why = refusal(exc)
        if why is not None:
            return BrokerConfigError(f"cannot use the broker at {where}: {why}")
    said = "; ".join(
        f"{where}: {exc if isinstance(exc, BrokerError) else repr(exc)}" for where, exc in failures
    )
    return BrokerUnavailableError(f"no broker node reachable: {said}")


def refusal(exc: BaseException) -> str | None:
    """What TLS refused, as one line with a hint, if ``exc`` is a TLS refusal; else None."""
    errors = list(_chain(exc))
    for err in errors:
        if isinstance(err, ssl.SSLCertVerificationError):
            said = str(err.verify_message or _reason(err)).rstrip(".")
            hint = _NAME_HINT if "mismatch" in said.lower() else _NOT_VERIFIED
            return f"TLS: the broker's certificate was refused: {said} ({hint})"
        if isinstance(err, ssl.SSLError) and not isinstance(err, _STREAM_ENDED):
            return _handshake(err.reason or "", _reason(err))
    if not any(isinstance(err, pika.exceptions.IncompatibleProtocolError) for err in errors):
        return None
    # the stream was lost after the TLS handshake, before the broker's AMQP greeting
    text = " ".join(str(err) for err in errors)
    found = _SSL_TEXT.search(text)
    if found:
        return _handshake(found["code"], found["reason"].strip())
    if _EOF_TEXT.search(text):
        return (
            "TLS: the broker closed the connection right after the handshake: it refused this "
            "client (no client certificate, or one not signed by a CA it trusts: "
            "broker.tls.cert_file / key_file)"
        )
    return None


def _handshake(code: str, reason: str) -> str:
    """A handshake error with the hint its OpenSSL code calls for."""
    upper = code.upper()
    if "CERTIFICATE_REQUIRED" in upper:
        hint = "the broker wants a client certificate: set broker.tls.cert_file and key_file"
    elif "UNKNOWN_CA" in upper or "BAD_CERTIFICATE" in upper:
        hint = "the broker does not trust this client's certificate (broker.tls.cert_file)"
    elif "VERIFY" in upper:
        hint = _NOT_VERIFIED
    elif "WRONG_VERSION" in upper or "RECORD" in upper:
        hint = "does that port speak TLS? RabbitMQ's default amqps port is 5671"
    else:
        hint = "broker.tls and the broker's ssl_options do not agree"
    return f"TLS handshake failed: {reason} ({hint})"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: pika's ``exception``/``exceptions``/``args``, causes."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        inner = [getattr(err, "exception", None), err.__cause__, err.__context__]
        inner += list(getattr(err, "exceptions", ()) or ())
        inner += [a for a in err.args if isinstance(a, BaseException)]
        todo += [e for e in inner if isinstance(e, BaseException)]


def _reason(exc: BaseException) -> str:
    """OpenSSL's or the OS's reason, without the ``[SSL: CODE]`` and ``(_ssl.c:123)`` noise."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return str(exc.verify_message)
    if isinstance(exc, ssl.SSLError):
        text = str(exc.args[1] if len(exc.args) > 1 else exc)
        return _SSL_NOISE.sub("", text) or "error"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
