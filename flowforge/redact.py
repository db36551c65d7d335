"""Secrets hidden in what is shown: a database or broker URL as it may be printed or logged."""

from __future__ import annotations

import re

#: A parameter whose value is a secret, in a URL query or a libpq ``key=value`` string; the value
#: runs to the next ``&``, ``#`` or blank, or is a quoted string.
_SECRET_PARAM = re.compile(
    r"((?:^|[?&;\s]))(\w*(?:pass|secret|token)\w*)\s*=\s*(?:'(?:[^'\\]|\\.)*'?|[^&#\s]*)",
    re.IGNORECASE,
)
#: Where a comma starts another URL (a list of broker nodes), not another host of the same URL.
_URL_START = re.compile(r",(?=\s*[a-z][a-z0-9+.-]*://)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with every secret shown as ``***``: safe to print or log.

    Handles a URL (``postgresql://``, ``amqp://``, ...; the password of its userinfo and any
    query parameter whose name holds ``pass``, ``secret`` or ``token``: ``password``,
    ``sslpassword``, ``oauth_client_secret``), several URLs separated by commas (a broker
    list), and a libpq ``key=value`` connection string (quoted values too). The user name, hosts,
    ports, database and other parameters stay visible.
    """
    urls = _URL_START.split(url)
    return ",".join(_SECRET_PARAM.sub(r"\1\2=***", _redact_userinfo(u)) for u in urls)


def _redact_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # the userinfo ends at the last "@" of the authority; a password holding a raw "/", "?" or
    # "#" (not percent-encoded) pushes that "@" further: then the last "@" of all is taken, so a
    # malformed URL is redacted too much rather than too little
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    at = authority.rfind("@")
    if at < 0:
        at = rest.rfind("@")
    if at < 0 or ":" not in rest[:at]:
        return url
    user = rest[:at].split(":", 1)[0]
    return f"{scheme}://{user}:***@{rest[at + 1 :]}"
