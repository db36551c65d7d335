"""Query-string and response helpers shared by the ``/api/v1`` resources.

Every parser here turns a bad value into a JSON 400 naming the parameter, so nothing the client
sends can reach PostgreSQL in a shape it refuses (a NUL character, a malformed time) and come
back as a 5xx.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import falcon

from flowforge.api.errors import json_error
from flowforge.views import dumps

MAX_PAGE = 500
MAX_TEXT_PARAM = 500


def send(resp: falcon.Response, data: Any, status: str = falcon.HTTP_200) -> None:
    """Answer ``data`` as JSON."""
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = dumps(data)


def limit(req: falcon.Request, default: int, maximum: int = MAX_PAGE) -> int:
    """``?limit=``: an integer from 1 to ``maximum``; ``default`` when absent."""
    raw = req.get_param("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise json_error(falcon.HTTP_400, f"limit must be an integer from 1 to {maximum}")
    return int(raw)


def text(req: falcon.Request, name: str) -> str | None:
    """An optional free-text filter (workflow, handler): None when absent."""
    raw = req.get_param(name)
    return None if raw is None else check_text(raw, name)


def check_text(value: str, name: str) -> str:
    """``value`` if PostgreSQL can store it as text and it is not absurdly long, else a 400."""
    if len(value) > MAX_TEXT_PARAM:
        raise json_error(falcon.HTTP_400, f"{name} is longer than {MAX_TEXT_PARAM} characters")
    return storable(value, name)


def storable(value: str, name: str) -> str:
    """``value`` if PostgreSQL text can hold it: no NUL, valid UTF-8 (JSON can carry a lone
    surrogate, which would only fail once sent). A 400 otherwise."""
    if "\x00" in value:
        raise json_error(falcon.HTTP_400, f"{name} cannot contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise json_error(falcon.HTTP_400, f"{name} is not valid Unicode text") from exc
    return value


def choice(req: falcon.Request, name: str, allowed: Collection[str]) -> str | None:
    """An optional enumerated value, in any case, returned as spelled in ``allowed``."""
    raw = req.get_param(name)
    if raw is None:
        return None
    for value in allowed:
        if raw.casefold() == value.casefold():
            return str(value)
    raise json_error(falcon.HTTP_400, f"{name} must be one of {', '.join(allowed)}")


def time(req: falcon.Request, name: str) -> datetime | None:
    """An optional ISO 8601 time; one without an offset is taken as UTC."""
    raw = req.get_param(name)
    if raw is None:
        return None
    try:
        return as_utc(datetime.fromisoformat(raw))
    except (ValueError, OverflowError) as exc:
        raise json_error(
            falcon.HTTP_400, f"{name} must be an ISO 8601 time (e.g. 2024-05-01T12:00:00Z)"
        ) from exc


def as_utc(value: datetime) -> datetime:
    """``value`` in UTC (naive: taken as UTC); OverflowError when UTC has no such time (year 1
    with a positive offset...), which PostgreSQL would refuse after the query was sent."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def encode_cursor(stamp: datetime, row_id: UUID) -> str:
    """An opaque keyset cursor: the (time, id) of the last row of a page."""
    return base64.urlsafe_b64encode(f"{stamp.isoformat()}|{row_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    """The (time, id) of :func:`encode_cursor`; a 400 for anything else."""
    try:
        stamp, _, rid = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        when = datetime.fromisoformat(stamp)
        if when.tzinfo is None:
            raise ValueError("a cursor time has an offset")
        return as_utc(when), UUID(rid)
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError) as exc:
        raise json_error(falcon.HTTP_400, "malformed cursor") from exc


def cursor(req: falcon.Request) -> tuple[datetime, UUID] | None:
    """``?cursor=`` decoded, or None when absent."""
    raw = req.get_param("cursor")
    return decode_cursor(raw) if raw is not None else None
