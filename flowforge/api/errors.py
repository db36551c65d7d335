"""Every error is a JSON body ``{"error": ...}``: a 4xx for what the caller sent, a 503 only for
an outage, a 500 for the rest.

FlowForge's own errors are mapped to statuses here; falcon's (404, 405, 413, ...) go through
the same serializer. A value PostgreSQL refuses is a 400, a broken constraint a 409. Anything
else (a database error that is no outage, a misconfigured database, a bug) is a 500 whose body
carries only an error id; the same id is logged with the full error and its traceback.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import falcon

from flowforge.errors import (
    BrokerUnavailableError,
    DatabaseConstraintError,
    DatabaseUnavailableError,
    DatabaseValueError,
    FlowForgeError,
    InputError,
    InvalidIdError,
    NotDeadError,
    NotFoundError,
    TriggerConflictError,
    UnknownWorkflowError,
)

logger = logging.getLogger(__name__)

#: First match wins.
STATUSES: tuple[tuple[type[FlowForgeError], str], ...] = (
    (InvalidIdError, falcon.HTTP_400),
    (InputError, falcon.HTTP_400),
    (UnknownWorkflowError, falcon.HTTP_422),
    (NotFoundError, falcon.HTTP_404),
    (NotDeadError, falcon.HTTP_409),
    (TriggerConflictError, falcon.HTTP_409),
    (DatabaseValueError, falcon.HTTP_400),
    (DatabaseConstraintError, falcon.HTTP_409),
    (DatabaseUnavailableError, falcon.HTTP_503),
    (BrokerUnavailableError, falcon.HTTP_503),
)


def json_error(status: str, message: str) -> falcon.HTTPError:
    return falcon.HTTPError(status, title=message)


def serialize_error(_req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError) -> None:
    """The one error body shape: ``{"error": message}``."""
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps({"error": exc.description or exc.title or "error"})


def handle_flowforge_error(
    _req: falcon.Request, _resp: falcon.Response, exc: FlowForgeError, _params: Any
) -> None:
    for kind, status in STATUSES:
        if isinstance(exc, kind):
            raise json_error(status, str(exc))
    raise internal_error(exc)


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
