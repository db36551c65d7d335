"""``/api/v1``: create, read, list and cancel runs; list and requeue dead tasks."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

import falcon

from flowforge.api.errors import json_error
from flowforge.api.security import read_json
from flowforge.client import Client
from flowforge.domain.states import RunState
from flowforge.views import dumps, run_dict, task_dict

MAX_KEY_LENGTH = 255
MAX_PAGE = 500
DEFAULT_PAGE = 50


def _send(resp: falcon.Response, data: Any, status: str = falcon.HTTP_200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = dumps(data)


def _limit(req: falcon.Request, default: int) -> int:
    raw = req.get_param("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_PAGE:
        raise json_error(falcon.HTTP_400, f"limit must be an integer from 1 to {MAX_PAGE}")
    return int(raw)


def encode_cursor(created_at: datetime, run_id: UUID) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{run_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    try:
        stamp, _, rid = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        return datetime.fromisoformat(stamp), UUID(rid)
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise json_error(falcon.HTTP_400, "malformed cursor") from exc


class Runs:
    """``POST /api/v1/runs`` (create, ``Idempotency-Key``) and ``GET /api/v1/runs`` (list)."""

    def __init__(self, client: Client, max_body: int) -> None:
        self._client = client
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self._max_body)
        workflow, run_input = _run_request(body)
        key = req.get_header("Idempotency-Key")
        if key is not None and not 0 < len(key) <= MAX_KEY_LENGTH:
            raise json_error(falcon.HTTP_400, f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} chars")
        result = self._client.trigger(workflow, run_input, key)
        run = self._client.status(result.run_id)
        resp.set_header("Location", f"/api/v1/runs/{run.id}")
        _send(resp, run_dict(run), falcon.HTTP_201 if result.created else falcon.HTTP_200)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        state = req.get_param("state")
        if state is not None and state.upper() not in RunState.__members__:
            raise json_error(falcon.HTTP_400, f"state must be one of {', '.join(RunState)}")
        limit = _limit(req, DEFAULT_PAGE)
        cursor = req.get_param("cursor")
        runs = self._client.repository.list_runs(
            state=state.upper() if state else None,
            workflow=req.get_param("workflow"),
            limit=limit + 1,
            before=decode_cursor(cursor) if cursor else None,
        )
        page = runs[:limit]
        more = len(runs) > limit
        _send(
            resp,
            {
                "runs": [run_dict(r, with_tasks=False) for r in page],
                "next_cursor": encode_cursor(page[-1].created_at, page[-1].id) if more else None,
            },
        )


def _run_request(body: Any) -> tuple[str, Mapping[str, Any]]:
    if not isinstance(body, dict):
        raise json_error(falcon.HTTP_400, "the body must be a JSON object")
    unknown = sorted(set(body) - {"workflow", "input"})
    if unknown:
        raise json_error(falcon.HTTP_400, f"unknown field {unknown[0]!r}")
    workflow = body.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise json_error(falcon.HTTP_400, "'workflow' must be a non-empty string")
    run_input = body.get("input", {})
    if not isinstance(run_input, dict):
        raise json_error(falcon.HTTP_400, "'input' must be a JSON object")
    return workflow, run_input


class OneRun:
    """``GET /api/v1/runs/{run_id}``: the same shape as ``flowforge status --json``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def on_get(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        _send(resp, run_dict(self._client.status(run_id)))


class CancelRun:
    """``POST /api/v1/runs/{run_id}/cancel``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def on_post(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        _send(resp, run_dict(self._client.cancel(run_id)))


class DeadTasks:
    """``GET /api/v1/dead``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        dead = self._client.repository.list_dead(limit=_limit(req, 100))
        _send(resp, {"tasks": [task_dict(t) for t in dead]})


class Requeue:
    """``POST /api/v1/task-runs/{task_run_id}/requeue`` with an optional ``{"reason"}``."""

    def __init__(self, client: Client, max_body: int) -> None:
        self._client = client
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        body = read_json(req, self._max_body, required=False) or {}
        if not isinstance(body, dict) or set(body) - {"reason", "requested_by"}:
            raise json_error(falcon.HTTP_400, "the body may only hold 'reason' and 'requested_by'")
        reason, by = body.get("reason"), body.get("requested_by", "api")
        if not (reason is None or isinstance(reason, str)) or not isinstance(by, str):
            raise json_error(falcon.HTTP_400, "'reason' and 'requested_by' must be strings")
        _send(resp, task_dict(self._client.requeue(task_run_id, by, reason)))
