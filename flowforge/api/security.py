"""Bearer-token authentication and cross-site request forgery checks for mutating requests,
security headers on every response, and the request-body limit."""

from __future__ import annotations

import hmac
import json
from typing import Any

import falcon

from flowforge.api.errors import json_error

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
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


class TokenAuth:
    """Middleware: a non-GET request needs ``Authorization: Bearer <token>``.

    Missing credentials → 401; a wrong token → 403. Tokens are compared in constant time. With
    no token configured every mutation is refused (403), never allowed.
    """

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.method in SAFE_METHODS:
            return
        header = req.get_header("Authorization") or ""
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            resp.set_header("WWW-Authenticate", 'Bearer realm="flowforge"')
            raise json_error(falcon.HTTP_401, "a bearer token is required")
        if self._token is None:
            raise json_error(falcon.HTTP_403, "mutations are disabled: no api token is configured")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise json_error(falcon.HTTP_403, "invalid token")


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
