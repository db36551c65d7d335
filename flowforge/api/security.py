"""Bearer-token authentication for mutating requests, and the request-body limit."""

from __future__ import annotations

import hmac
import json
from typing import Any

import falcon

from flowforge.api.errors import json_error

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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
