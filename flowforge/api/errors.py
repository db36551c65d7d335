"""Every error is a JSON body ``{"error": ...}``: a 4xx for what the caller sent, a 503 only for
an outage, a 500 for the rest.

FlowForge's own errors get their status from the one error map (flowforge/errormap.py, shared
with the command's exit codes); falcon's (404, 405, 413, ...) go through the same serializer. A
value PostgreSQL refuses is a 400, a broken constraint a 409. Anything else (a database error that
is no outage, a misconfigured database, a bug) is a 500 whose body carries only an error id; the
same id is logged with the full error and its traceback.
"""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus
from typing import Any

import falcon

from flowforge.errormap import http_status_for
from flowforge.errors import FlowForgeError

logger = logging.getLogger(__name__)


def json_error(status: str, message: str) -> falcon.HTTPError:
    return falcon.HTTPError(status, title=message)


def serialize_error(_req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError) -> None:
    """The one error body shape: ``{"error": message}``."""
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps({"error": exc.description or exc.title or "error"})


def handle_flowforge_error(
    _req: falcon.Request, _resp: falcon.Response, exc: FlowForgeError, _params: Any
) -> None:
    status = http_status_for(exc)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR:
        raise internal_error(exc)  # its message is for the log only
    raise json_error(falcon.code_to_http_status(status), str(exc))


def handle_unexpected(
    _req: falcon.Request, _resp: falcon.Response, exc: Exception, _params: Any
) -> None:
    if isinstance(exc, falcon.HTTPError):
        raise exc
    raise internal_error(exc)


def internal_error(exc: BaseException) -> falcon.HTTPError:
    """A 500 naming a fresh error id; the id is logged with ``exc`` and its traceback."""
    error_id = uuid.uuid4().hex[:12]
    logger.error(
        "internal error %s: %s: %s",
        error_id,
        type(exc).__name__,
        exc,
        exc_info=exc,
        extra={"action": "internal_error", "error_id": error_id},
    )
    return json_error(falcon.HTTP_500, f"internal error (id {error_id})")
