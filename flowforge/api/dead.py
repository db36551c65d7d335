"""Dead tasks: ``GET /api/v1/dead`` (filtered, paginated), requeue one, requeue all matching.

Every requeue goes through :meth:`Operator.requeue_dead`'s transaction and writes an audit
row with the reason given. A bulk requeue takes at most :data:`MAX_BULK_REQUEUE` tasks per
request (the response says how many matched, so the caller can repeat), and its dry run
changes nothing.
"""

from __future__ import annotations

from typing import Any

import falcon

from flowforge.api import params
from flowforge.api.control import note
from flowforge.api.errors import json_error
from flowforge.api.security import read_json
from flowforge.domain.model import DeadFilter
from flowforge.domain.reasons import FailureReason
from flowforge.store.operator import Operator
from flowforge.store.reads import Reads
from flowforge.views import task_dict

DEFAULT_PAGE = 100
#: One bulk request requeues at most this many tasks (one transaction each).
MAX_BULK_REQUEUE = 1000
BULK_FIELDS = frozenset(
    {"reason", "requested_by", "reason_filter", "workflow", "handler", "dry_run"}
)
BULK_REQUESTER = "dashboard"


class DeadTasks:
    """``GET /api/v1/dead?reason=&workflow=&handler=&limit=&cursor=``.

    ``{"tasks": [task + "workflow"], "next_cursor"}``, newest death first.
    """

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        reason = params.choice(req, "reason", list(FailureReason))
        match = DeadFilter(
            reason=FailureReason(reason) if reason else None,
            workflow=params.text(req, "workflow"),
            handler=params.text(req, "handler"),
        )
        limit = params.limit(req, DEFAULT_PAGE)
        found = self._reads.list_dead(limit + 1, match=match, before=params.cursor(req))
        page = found[:limit]
        last = page[-1] if len(found) > limit else None
        next_cursor = None
        if last is not None and last.finished_at is not None:
            next_cursor = params.encode_cursor(last.finished_at, last.id)
        params.send(resp, {"tasks": [task_dict(t) for t in page], "next_cursor": next_cursor})


class Requeue:
    """``POST /api/v1/task-runs/{task_run_id}/requeue`` with an optional ``{"reason"}``."""

    def __init__(self, operator: Operator, max_body: int) -> None:
        self._operator = operator
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, task_run_id: str) -> None:
        by, reason = note(req, self._max_body)
        params.send(resp, task_dict(self._operator.requeue_dead(task_run_id, by, reason)))


class BulkRequeue:
    """``POST /api/v1/dead/requeue``: requeue every dead task matching the filters.

    Body: ``{"reason": str (required), "reason_filter", "workflow", "handler": str or null,
    "dry_run": bool, "requested_by": str}``. Answer: ``{"dry_run", "matched", "requeued",
    "skipped", "limit", "more", "requeued_ids"}`` — ``matched`` counts every match, at most
    ``limit`` are requeued per request and ``more`` says whether matches remain beyond it.
    """

    def __init__(self, operator: Operator, max_body: int) -> None:
        self._operator = operator
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = _bulk_request(read_json(req, self._max_body))
        outcome = self._operator.requeue_dead_matching(
            body["match"],
            body["requested_by"],
            body["reason"],
            MAX_BULK_REQUEUE,
            dry_run=body["dry_run"],
        )
        params.send(
            resp,
            {
                "dry_run": outcome.dry_run,
                "matched": outcome.matched,
                "requeued": len(outcome.requeued),
                "skipped": len(outcome.skipped),
                "limit": outcome.limit,
                "more": outcome.matched > outcome.limit,
                "requeued_ids": list(outcome.requeued),
            },
        )


def _bulk_request(body: Any) -> dict[str, Any]:
    """The validated fields of a bulk requeue request; a 400 naming the first problem."""
    if not isinstance(body, dict):
        raise json_error(falcon.HTTP_400, "the body must be a JSON object")
    unknown = sorted(set(body) - BULK_FIELDS)
    if unknown:
        raise json_error(falcon.HTTP_400, f"unknown field {unknown[0]!r}")
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise json_error(falcon.HTTP_400, "'reason' is required: say why these are requeued")
    by = body.get("requested_by", BULK_REQUESTER)
    if not isinstance(by, str) or not by:
        raise json_error(falcon.HTTP_400, "'requested_by' must be a non-empty string")
    params.storable(reason, "reason")
    params.storable(by, "requested_by")
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise json_error(falcon.HTTP_400, "'dry_run' must be true or false")
    filters: dict[str, str | None] = {}
    for name in ("reason_filter", "workflow", "handler"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise json_error(falcon.HTTP_400, f"'{name}' must be a string or null")
        filters[name] = params.check_text(value, name) if value else None
    failure = filters["reason_filter"]
    if failure is not None and failure not in set(FailureReason):
        raise json_error(
            falcon.HTTP_400, f"'reason_filter' must be one of {', '.join(FailureReason)}"
        )
    match = DeadFilter(
        reason=FailureReason(failure) if failure else None,
        workflow=filters["workflow"],
        handler=filters["handler"],
    )
    return {"match": match, "reason": reason, "requested_by": by, "dry_run": dry_run}
