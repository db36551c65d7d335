"""Who may use the api: the ``Host`` check (DNS rebinding), bearer-token authentication of
mutations (and of reads under ``api.read_access: token``), cross-site request forgery checks,
the access log, security headers on every response, and the request-body limit."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Sequence
from typing import Any

import falcon

from flowforge.api.errors import json_error
from flowforge.config import IPNetwork, ReadAccess
from flowforge.text import escape

access_log = logging.getLogger("flowforge.api.access")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Under ``read_access: token`` a read of these needs the token too (the dashboard's shell,
#: its assets and the health probes stay open: they hold no data).
READ_PROTECTED_PREFIXES = ("/api/",)
READ_PROTECTED_PATHS = frozenset({"/metrics"})
#: Probes address the api by whatever name or address the orchestrator uses (a pod's IP):
#: they answer nothing secret, so the ``Host`` check lets them through.
HOST_EXEMPT_PATHS = frozenset({"/health/live", "/health/ready"})
MISDIRECTED = "421 Misdirected Request"
#: Bodies a browser may send cross-site without a CORS preflight (an HTML form can).
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
CROSS_SITE = frozenset({"cross-site", "same-site"})
DEFAULT_PORTS = {"http": "80", "https": "443"}
#: The pages load scripts, styles and icons from /ui/static and talk to this origin only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class HostCheck:
    """Middleware, first of all: refuse (421, JSON) a request whose ``Host`` header is not one
    of ``hosts`` — a page on another name that resolves to this address (DNS rebinding) must
    not read the api through the victim's browser.

    An entry with a port must match exactly; one without matches that host on any port; ``*``
    allows every host. A request with no ``Host`` header at all (HTTP/1.0) passes: a browser
    always sends one. The health probes are exempt (``HOST_EXEMPT_PATHS``).
    """

    def __init__(self, hosts: tuple[str, ...]) -> None:
        self._any = "*" in hosts
        self._hosts = frozenset(h.lower() for h in hosts)

    def allows(self, host: str) -> bool:
        """Whether the ``Host`` header value ``host`` is allowed."""
        host = host.strip().lower()
        if self._any or host in self._hosts:
            return True
        name, sep, port = host.rpartition(":")
        return bool(sep) and port.isdigit() and not name.endswith(":") and name in self._hosts

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        host = req.get_header("Host")
        if host is None or req.path in HOST_EXEMPT_PATHS or self.allows(host):
            return
        raise json_error(MISDIRECTED, f'host "{escape(host[:100])}" is not served here')


class TokenAuth:
    """Middleware: a non-GET request needs ``Authorization: Bearer <token>``; so does a read of
    ``/api/...`` or ``/metrics`` when ``read_access`` is ``token``.

    Missing credentials → 401; a wrong token → 403. Tokens are compared in constant time. With
    no token configured every request that needs one is refused (403), never allowed.
    """

    def __init__(self, token: str | None, read_access: ReadAccess = ReadAccess.TOKEN) -> None:
        self._token = token.encode() if token else None
        self._reads = read_access is ReadAccess.TOKEN

    def needs_token(self, req: falcon.Request) -> bool:
        if req.method not in SAFE_METHODS:
            return True
        if not self._reads or req.method == "OPTIONS":
            return False
        return req.path in READ_PROTECTED_PATHS or req.path.startswith(READ_PROTECTED_PREFIXES)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.needs_token(req):
            return
        header = req.get_header("Authorization") or ""
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            resp.set_header("WWW-Authenticate", 'Bearer realm="flowforge"')
            raise json_error(falcon.HTTP_401, "a bearer token is required")
        if self._token is None:
            what = "mutations are" if req.method not in SAFE_METHODS else "reads are"
            raise json_error(falcon.HTTP_403, f"{what} disabled: no api token is configured")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise json_error(falcon.HTTP_403, "invalid token")


class AccessLog:
    """Middleware: one INFO line on ``flowforge.api.access`` per mutating request and per
    refused authentication (401/403): method, path (never the query string), status and the
    client's address — never another header. Control characters in the path are escaped (a
    request must not be able to forge log lines).

    The client is the connection's peer, unless the peer is one of ``trusted`` (reverse
    proxies): then it is read from ``X-Forwarded-For`` (see :func:`forwarded_client`), and the
    line names the proxy too (``from CLIENT via PROXY``)."""

    def __init__(self, trusted: Sequence[IPNetwork] = ()) -> None:
        self._trusted = tuple(trusted)

    def client(self, req: falcon.Request) -> tuple[str, str | None]:
        """``(client, proxy)``: the address the line names, and the proxy it came through
        (None when the peer is not a trusted proxy or sent no ``X-Forwarded-For``)."""
        peer = req.remote_addr
        header = req.get_header("X-Forwarded-For") if self._trusted else None
        if not header or not _within(peer, self._trusted):
            return peer, None
        return forwarded_client(header, peer, self._trusted), peer

    def process_response(
        self,
        req: falcon.Request,
        resp: falcon.Response,
        resource: object,
        req_succeeded: bool,
    ) -> None:
        status = resp.status_code
        if req.method in SAFE_METHODS and status not in (401, 403):
            return
        method, path = escape(req.method), escape(req.path)
        client, proxy = self.client(req)
        extra = {"action": "api_access", "method": method, "path": path, "status": status}
        if proxy is None:
            access_log.info(
                "%s %s %d from %s", method, path, status, client, extra={**extra, "client": client}
            )
            return
        access_log.info(
            "%s %s %d from %s via %s",
            method,
            path,
            status,
            client,
            proxy,
            extra={**extra, "client": client, "proxy": proxy},
        )


def forwarded_client(header: str, peer: str, trusted: Sequence[IPNetwork]) -> str:
    """The client ``X-Forwarded-For`` names, as far as trusted proxies vouch for it.

    Each proxy appends the address it was reached from, so the list is read from the right:
    the first address outside ``trusted`` is the client (what is left of it, the client could
    have written itself). When every address is trusted, the leftmost is the client. An entry
    that is not an address ends the walk: the last address vouched for (a trusted proxy's) is
    named, never text a client sent.
    """
    vouched = peer
    for hop in reversed(header.split(",")):
        address = _address(hop.strip())
        if address is None:
            return vouched
        vouched = str(address)
        if not any(address in network for network in trusted):
            return vouched
    return vouched


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def _within(text: str, trusted: Sequence[IPNetwork]) -> bool:
    address = _address(text)
    return address is not None and any(address in network for network in trusted)


class CsrfGuard:
    """Middleware: refuse a mutating request a browser sent on another site's behalf.

    The bearer token (never a cookie) already keeps other sites out; this is defence in depth
    and runs before authentication. 403 when ``Sec-Fetch-Site`` says ``cross-site`` or
    ``same-site``, or when an ``Origin`` header is present and its host and port are not the
    ``Host`` the request came to (``null`` never matches; the scheme is not compared, so a
    TLS-terminating proxy that passes ``Host`` on still works). 415 for a body an HTML form
    could send (url-encoded, multipart, text/plain): the api only reads JSON.
    """

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.method in SAFE_METHODS:
            return
        site = (req.get_header("Sec-Fetch-Site") or "").strip().lower()
        if site in CROSS_SITE:
            raise json_error(
                falcon.HTTP_403, f"cross-site request refused (Sec-Fetch-Site: {site})"
            )
        origin = req.get_header("Origin")
        if origin is not None and origin_netloc(origin) != own_netloc(req):
            raise json_error(falcon.HTTP_403, "cross-origin request refused")
        media = (req.content_type or "").partition(";")[0].strip().lower()
        if media in FORM_TYPES:
            raise json_error(falcon.HTTP_415, f"{media} bodies are refused: send application/json")


def origin_netloc(origin: str) -> str | None:
    """``host[:port]`` of an ``Origin`` header (default port dropped), None if it has none."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or not rest or "/" in rest.rstrip("/"):
        return None
    return _without_default_port(rest.rstrip("/"), DEFAULT_PORTS.get(scheme))


def own_netloc(req: falcon.Request) -> str:
    """``host[:port]`` the client addressed (its ``Host`` header), default port dropped."""
    return _without_default_port(req.netloc.lower(), DEFAULT_PORTS.get(req.scheme))


def _without_default_port(netloc: str, default: str | None) -> str:
    if default is not None and netloc.endswith(f":{default}"):
        return netloc[: -len(default) - 1]
    return netloc


class SecurityHeaders:
    """Middleware: every response forbids framing, MIME sniffing, referrers and any script,
    style or connection not from this origin."""

    def process_response(
        self,
        req: falcon.Request,
        resp: falcon.Response,
        resource: object,
        req_succeeded: bool,
    ) -> None:
        for name, value in SECURITY_HEADERS.items():
            resp.set_header(name, value)


def read_json(req: falcon.Request, limit: int, required: bool = True) -> Any:
    """The request body as JSON, at most ``limit`` bytes; 413 above, 400 when malformed."""
    if req.content_length is not None and req.content_length > limit:
        raise json_error(falcon.HTTP_413, f"request body larger than {limit} bytes")
    raw = req.bounded_stream.read(limit + 1)
    if len(raw) > limit:
        raise json_error(falcon.HTTP_413, f"request body larger than {limit} bytes")
    if not raw.strip():
        if required:
            raise json_error(falcon.HTTP_400, "a JSON body is required")
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise json_error(falcon.HTTP_400, f"malformed JSON: {str(exc)[:200]}") from exc
