"""Map tasks (``for_each``, SPEC 7.3): what an expansion makes of an upstream result. Pure.

A map task runs once per item of its upstream task's JSON-list result. When that upstream has
succeeded, a scheduler pass judges the result here — a list of at most ``max_items`` items,
whose key templates render for every item — and then inserts every item task run in one
statement (``expand_map`` in queries.sql), or buries the map with one of the reasons below.

Key templates of a map task (idempotency, ordering, concurrency and rate keys) are rendered per
item over the run input plus two names: ``item`` (the item itself, so ``{item[field]}`` reads a
field of a mapping item and ``{item[0]}`` an element of a list item) and ``index`` (its position
from 0). They shadow run-input keys of the same names.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowforge.domain.breakers import check_breaker_key
from flowforge.domain.dag import DEFAULT_MAX_ITEMS
from flowforge.domain.keys import render_key
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import check_text
from flowforge.errors import InputError, UnstorableValueError


@dataclass(frozen=True)
class ItemKeys:
    """Each item's rendered keys, in item order; None for a key the task has no template for.
    ``rate_keys`` are the map's handler name for every item when its ``rate_limit`` names no
    key (the handler's limit, as on any task). The limits are the map's, the same for every
    item (None: no such limit)."""

    idempotency_keys: list[str | None]
    ordering_keys: list[str | None]
    concurrency_keys: list[str | None]
    rate_keys: list[str | None]
    breaker_keys: list[str | None]
    concurrency_limit: int | None = None
    rate_limit: int | None = None
    rate_per_s: float | None = None


@dataclass(frozen=True)
class MapFailure:
    """Why a map cannot expand: the map task ends DEAD with ``reason`` and ``error``."""

    reason: FailureReason
    error: str


def item_name(task: str, index: int) -> str:
    """The task-run name of item ``index`` of map ``task`` (also what expand_map writes)."""
    return f"{task}[{index}]"


def plan_items(
    source: Any,
    run_input: Mapping[str, Any],
    templates: Mapping[str, Any],
    max_items: int | None,
    *,
    source_name: str = "the upstream task",
) -> ItemKeys | MapFailure:
    """Judge ``source`` (the upstream result) and render the items' keys.

    ``templates``: the map task's stored definition (its ``idempotency_key``,
    ``ordering_key``, ``concurrency``, ``rate_limit`` and ``circuit_breaker`` entries and its
    ``handler`` are used); ``max_items``: the workflow's bound (None: 10,000).
    """
    bound = DEFAULT_MAX_ITEMS if max_items is None else int(max_items)
    if not isinstance(source, list):
        kind = "null" if source is None else type(source).__name__
        return MapFailure(
            FailureReason.NOT_A_LIST,
            f"for_each: the result of {source_name} must be a JSON list, not {kind}",
        )
    if len(source) > bound:
        return MapFailure(
            FailureReason.TOO_MANY_ITEMS,
            f"for_each: the result of {source_name} has {len(source)} items, more than "
            f"max_items ({bound})",
        )
    concurrency = templates.get("concurrency") or {}
    rate = templates.get("rate_limit") or {}
    try:
        rate_keys: list[str | None]
        if rate and rate.get("key") is None:  # the handler's limit, as on any task
            rate_keys = [str(templates.get("handler"))] * len(source)
        else:
            rate_keys = _render_all(rate.get("key"), run_input, source, "rate_limit.key")
        return ItemKeys(
            idempotency_keys=_render_all(
                templates.get("idempotency_key"), run_input, source, "idempotency_key"
            ),
            ordering_keys=_render_all(
                templates.get("ordering_key"), run_input, source, "ordering_key"
            ),
            concurrency_keys=_render_all(
                concurrency.get("key"), run_input, source, "concurrency.key"
            ),
            rate_keys=rate_keys,
            breaker_keys=[
                None if key is None else check_breaker_key(key, "item circuit_breaker.key")
                for key in _render_all(
                    _breaker_template(templates), run_input, source, "circuit_breaker.key"
                )
            ],
            concurrency_limit=concurrency.get("limit"),
            rate_limit=rate.get("limit"),
            rate_per_s=None if not rate else float(rate["per"]),
        )
    except (InputError, UnstorableValueError) as exc:
        return MapFailure(FailureReason.ITEM_KEY_ERROR, str(exc))


def _breaker_template(templates: Mapping[str, Any]) -> str | None:
    breaker = templates.get("circuit_breaker")
    key = breaker.get("key") if isinstance(breaker, Mapping) else None
    return key if isinstance(key, str) else None


def _render_all(
    template: str | None, run_input: Mapping[str, Any], items: Sequence[Any], name: str
) -> list[str | None]:
    if template is None:
        return [None] * len(items)
    keys: list[str | None] = []
    for index, item in enumerate(items):
        label = f"item {index}: {name} template"
        scope = {**run_input, "item": item, "index": index}
        keys.append(check_text(render_key(template, scope, label), label))
    return keys


def summary(counts: Mapping[str, int]) -> str:
    """A map's items in one line: ``"5 items: 3 SUCCEEDED, 2 RUNNING"`` (states by count)."""
    total = sum(counts.values())
    parts = [f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    noun = "item" if total == 1 else "items"
    return f"{total} {noun}" + (": " + ", ".join(parts) if parts else "")


#: A page of items: ``limit`` is at most this (the api's bound on every list).
MAX_ITEMS_PAGE = 500
#: The highest item index a cursor may carry (``item_index`` is a PostgreSQL integer).
MAX_ITEM_INDEX = 2**31 - 1
_CURSOR_PREFIX = "item:"


def item_cursor(index: int) -> str:
    """The opaque cursor of the page after item ``index`` (the last item of a page): base64url
    of ``item:<index>``, unpadded, so it travels in a query string as is."""
    raw = f"{_CURSOR_PREFIX}{index}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_index(cursor: str, label: str = "cursor") -> int:
    """The item index a cursor of :func:`item_cursor` pages after; :class:`InputError` naming
    ``label`` for anything else (a runs cursor, a bare number, padding or characters the
    encoder never writes: only its exact output is accepted)."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (ValueError, binascii.Error, UnicodeError):
        text = ""
    digits = text.removeprefix(_CURSOR_PREFIX)
    if (
        text.startswith(_CURSOR_PREFIX)
        and digits.isascii()
        and digits.isdigit()
        and int(digits) <= MAX_ITEM_INDEX
        and item_cursor(int(digits)) == cursor
    ):
        return int(digits)
    raise InputError(f"{label} is malformed: pass the next_cursor of an earlier page")


def item_state(value: str | TaskState | None, label: str = "state") -> TaskState | None:
    """A state to filter items by, in any case; None for none; :class:`InputError` naming
    ``label`` for a word that is no task state."""
    if value is None or isinstance(value, TaskState):
        return value
    found = TaskState.__members__.get(value.upper()) if value.isascii() else None
    if found is None:
        raise InputError(f"{label} must be one of {', '.join(TaskState)}")
    return found


def page_limit(value: int, label: str = "limit") -> int:
    """``value`` if it is a page size from 1 to :data:`MAX_ITEMS_PAGE`, else :class:`InputError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ITEMS_PAGE:
        raise InputError(f"{label} must be an integer from 1 to {MAX_ITEMS_PAGE}")
    return value
