"""Every error is a JSON body ``{"error": ...}`` with a 4xx (or 503) status — never a 500.

FlowForge's own errors are mapped to statuses here; falcon's (404, 405, 413, ...) go through
the same serializer; anything unexpected is logged and answered as a JSON 500 with no detail.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import falcon

from flowforge.errors import (
    BrokerUnavailableError,
    DatabaseUnavailableError,
    FlowForgeError,
    InputError,
    InvalidIdError,
    NotDeadError,
    NotFoundError,
    StoreError,
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
    (DatabaseUnavailableError, falcon.HTTP_503),
    (BrokerUnavailableError, falcon.HTTP_503),
    (StoreError, falcon.HTTP_503),
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
    logger.exception("unexpected engine error", exc_info=exc)
    raise json_error(falcon.HTTP_500, "internal error")


def handle_unexpected(
    _req: falcon.Request, _resp: falcon.Response, exc: Exception, _params: Any
) -> None:
    if isinstance(exc, falcon.HTTPError):
        raise exc
    logger.exception("unexpected error in the api", exc_info=exc)
    raise json_error(falcon.HTTP_500, "internal error")
