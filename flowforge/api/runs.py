"""``/api/v1/runs``: create, read, list, cancel and rerun runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.api.security import read_json
from flowforge.client import Client
from flowforge.domain.plan import RunRequest
from flowforge.domain.states import RunState
from flowforge.domain.timing import parse_instant, seconds
from flowforge.durations import parse_duration
from flowforge.errors import InputError
from flowforge.store.operator import Operator
from flowforge.store.reads import Reads
from flowforge.views import run_dict, to_dict

MAX_KEY_LENGTH = 255
DEFAULT_PAGE = 50
#: Runs one ``POST /api/v1/runs:batch`` may create (more: 413 naming the limit).
MAX_BATCH = 1000


class Runs:
    """``POST /api/v1/runs`` (create, ``Idempotency-Key``) and ``GET /api/v1/runs`` (list).

    Runs are created through the :class:`Client`, which knows the workflows; requests that
    arrive together share a transaction (:meth:`Client.trigger`'s group commit)."""

    def __init__(self, client: Client, reads: Reads, max_body: int) -> None:
        self._client = client
        self._reads = reads
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self._max_body)
        workflow, run_input = _run_request(body)
        timing = _timing(body)
        if body.get("priority") is not None:  # checked by the trigger: 400 naming it
            timing["priority"] = body["priority"]
        key = _key(req.get_header("Idempotency-Key"), "Idempotency-Key")
        # concurrent POSTs share a commit (Client.trigger's group commit)
        result = self._client.trigger(workflow, run_input, key, **timing, with_run=True)
        # the run as the trigger wrote it; a replayed key (or a task under limits) reads it back
        run = result.run or self._reads.get_run(result.run_id)
        resp.set_header("Location", f"/api/v1/runs/{run.id}")
        params.send(resp, run_dict(run), falcon.HTTP_201 if result.created else falcon.HTTP_200)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``?state=&workflow=&since=&until=&limit=&cursor=``: ``{"runs", "next_cursor"}``,
        newest first; ``since``/``until`` bound the creation time to [since, until)."""
        limit = params.limit(req, DEFAULT_PAGE)
        runs = self._reads.list_runs(
            state=params.choice(req, "state", list(RunState)),
            workflow=params.text(req, "workflow"),
            since=params.time(req, "since"),
            until=params.time(req, "until"),
            limit=limit + 1,
            before=params.cursor(req),
        )
        page = runs[:limit]
        more = len(runs) > limit
        params.send(
            resp,
            {
                "runs": [run_dict(r, with_tasks=False) for r in page],
                "next_cursor": (
                    params.encode_cursor(page[-1].created_at, page[-1].id) if more else None
                ),
            },
        )


def _key(key: Any, name: str) -> str | None:
    """An idempotency key as given (None: none), or a 400: 1 to MAX_KEY_LENGTH characters."""
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH):
        raise json_error(falcon.HTTP_400, f"{name} must be 1-{MAX_KEY_LENGTH} chars")
    return key


class RunsBatch:
    """``POST /api/v1/runs:batch``: ``{"runs": [{"workflow", "input", "idempotency_key",
    "priority", "start_at", "delay", "deadline"}, ...]}`` — up to :data:`MAX_BATCH` runs, of
    any workflows, each as ``POST /api/v1/runs`` takes one (its key in the item, not a header),
    created in one transaction (:meth:`Client.trigger_batch`).

    All or nothing: a bad item is a 4xx naming its place (``runs[N]: ...``) and nothing is
    created. Answers ``{"runs": [{"id", "created"}, ...]}`` in the items' order, 201 if any run
    was created, 200 if every key replayed (``created`` false)."""

    def __init__(self, client: Client, max_body: int) -> None:
        self._client = client
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.get_header("Idempotency-Key") is not None:
            raise json_error(
                falcon.HTTP_400,
                "Idempotency-Key names one run: give each item its own 'idempotency_key'",
            )
        body = read_json(req, self._max_body)
        if not isinstance(body, dict) or set(body) != {"runs"}:
            raise json_error(falcon.HTTP_400, 'the body must be {"runs": [...]}')
        items = body["runs"]
        if not isinstance(items, list) or not items:
            raise json_error(falcon.HTTP_400, "'runs' must be a non-empty array")
        if len(items) > MAX_BATCH:
            raise json_error(
                falcon.HTTP_413, f"at most {MAX_BATCH} runs per batch, not {len(items)}"
            )
        requests = [_batch_item(index, item) for index, item in enumerate(items)]
        results = self._client.trigger_batch(requests)
        created = any(r.created for r in results)
        params.send(
            resp,
            {"runs": [{"id": r.run_id, "created": r.created} for r in results]},
            falcon.HTTP_201 if created else falcon.HTTP_200,
        )


def _batch_item(index: int, item: Any) -> RunRequest:
    """Item ``index`` of a batch as a :class:`RunRequest`; a 400 naming it when it is bad."""
    try:
        workflow, run_input = _run_request(item, ("idempotency_key",), "an item")
        timing = _timing(item)
        return RunRequest(
            workflow,
            run_input,
            _key(item.get("idempotency_key"), "'idempotency_key'"),
            start_at=timing.get("start_at"),
            delay=timing.get("delay"),
            deadline=timing.get("deadline"),
            priority=item.get("priority"),
        )
    except falcon.HTTPError as exc:
        status = falcon.code_to_http_status(exc.status)
        raise json_error(status, f"runs[{index}]: {exc.title}") from exc
    except InputError as exc:
        raise InputError(f"runs[{index}]: {exc}") from exc


def _run_request(
    body: Any, more: tuple[str, ...] = (), what: str = "the body"
) -> tuple[str, Mapping[str, Any]]:
    """``body``'s workflow and input, its fields checked (``more``: fields it may have besides
    those of ``POST /api/v1/runs``); a 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise json_error(falcon.HTTP_400, f"{what} must be a JSON object")
    unknown = sorted(set(body) - {"workflow", "input", "priority", *TIMING_FIELDS, *more})
    if unknown:
        raise json_error(falcon.HTTP_400, f"unknown field {unknown[0]!r}")
    workflow = body.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise json_error(falcon.HTTP_400, "'workflow' must be a non-empty string")
    run_input = body.get("input", {})
    if not isinstance(run_input, dict):
        raise json_error(falcon.HTTP_400, "'input' must be a JSON object")
    return workflow, run_input


#: Optional fields of ``POST /api/v1/runs`` that time a run (docs/time.md).
TIMING_FIELDS = ("start_at", "delay", "deadline")


def _timing(body: Mapping[str, Any]) -> dict[str, Any]:
    """``start_at`` (ISO 8601 with an offset), ``delay`` and ``deadline`` (a duration such as
    ``"10m"``, or a number of seconds) as the client's keyword arguments; a bad one is an
    :class:`InputError` naming the field (HTTP 400). Range checks are the trigger's."""
    timing: dict[str, Any] = {}
    if body.get("start_at") is not None:
        timing["start_at"] = parse_instant(body["start_at"], "'start_at'")
    for name in ("delay", "deadline"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            try:
                value = parse_duration(value)
            except ValueError as exc:
                raise InputError(f"'{name}': {exc}") from exc
        timing[name] = seconds(value, f"'{name}'")
    return timing


class OneRun:
    """``GET /api/v1/runs/{run_id}``: the same shape as ``flowforge status --json``."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def on_get(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        params.send(resp, run_dict(self._reads.get_run(run_id)))


class CancelRun:
    """``POST /api/v1/runs/{run_id}/cancel``."""

    def __init__(self, operator: Operator) -> None:
        self._operator = operator

    def on_post(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        params.send(resp, run_dict(self._operator.cancel_run(run_id)))


#: What a rerun request may hold.
RERUN_FIELDS = frozenset({"from", "reason", "requested_by"})


class RerunRun:
    """``POST /api/v1/runs/{run_id}/rerun`` with an optional ``{"from", "reason",
    "requested_by"}``: a finished run runs again from its failed tasks (or from ``from``),
    audited; ``GET`` lists the run's reruns (who, when, why, which tasks)."""

    def __init__(self, operator: Operator, max_body: int) -> None:
        self._operator = operator
        self._max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        body = read_json(req, self._max_body, required=False) or {}
        if not isinstance(body, dict) or set(body) - RERUN_FIELDS:
            raise json_error(
                falcon.HTTP_400, "the body may only hold 'from', 'reason' and 'requested_by'"
            )
        by = body.get("requested_by", "api")
        if not isinstance(by, str):
            raise json_error(falcon.HTTP_400, "'requested_by' must be a string")
        params.storable(by, "requested_by")
        reason, from_task = _optional_text(body, "reason"), _optional_text(body, "from")
        done = self._operator.rerun(run_id, by, reason, from_task)
        params.send(
            resp,
            {
                "run": run_dict(done.run),
                "previous_state": done.previous_state,
                "task_run_ids": list(done.task_ids),
                "task_names": list(done.task_names),
            },
        )

    def on_get(self, _req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        self._operator.get_run(run_id)  # 404 for an unknown run, 400 for a malformed id
        history = self._operator.rerun_history(run_id)
        params.send(resp, {"reruns": [to_dict(entry) for entry in history]})


def _optional_text(body: Mapping[str, Any], name: str) -> str | None:
    """``body[name]``: absent or null is None, a string PostgreSQL can store, else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise json_error(falcon.HTTP_400, f"'{name}' must be a string")
    return params.storable(value, name)
