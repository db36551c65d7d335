"""Key templates: ``str.format`` templates over a run's input that name a task's idempotency,
ordering, concurrency, rate-limit, breaker and event keys.

Only plain names and ``[index]`` lookups are allowed in them, never attribute access, so a
template cannot reach beyond the values it is given. Pure: no I/O.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from flowforge.domain.values import check_text
from flowforge.errors import DefinitionError, InputError, UnstorableValueError

_FIELD_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^\[\]]+\])*")


def check_template(template: str, label: str) -> None:
    """Refuse a key template that cannot be parsed or reaches beyond plain input lookups.

    Fields nested in a format spec (``{a:{b}}``) are checked too, since ``str.format``
    evaluates them as well.
    """
    if not isinstance(template, str):  # Python code can pass anything
        raise DefinitionError(f"{label}: must be a template string, not {type(template).__name__}")
    try:
        fields = template_fields(template)
        check_text(template, label)  # its literal text reaches PostgreSQL in every key
    except ValueError as exc:
        raise DefinitionError(f"{label}: malformed template {template!r}: {exc}") from exc
    except UnstorableValueError as exc:
        raise DefinitionError(str(exc)) from exc
    for name in fields:
        if not _FIELD_PATTERN.fullmatch(name):
            raise DefinitionError(
                f"{label}: template field {{{name}}} must be an input key, optionally indexed"
            )


def render_key(template: str, run_input: Mapping[str, Any], label: str) -> str:
    """Format a key template with the run input; :class:`InputError` names what is missing."""
    try:
        return template.format_map(run_input)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(
            f"{label}: cannot format {template!r} from the run input: {exc!r}"
        ) from exc


def template_fields(template: str) -> list[str]:
    """The fields of a template (``item[id]``, ``index``), those nested in a format spec too:
    ``str.format`` evaluates them as well. ``ValueError`` if it cannot be parsed."""
    found: list[str] = []
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is not None:
            found.append(name)
        if spec:
            found.extend(template_fields(spec))
    return found


class _AnyItem:
    """Stands for an item not known yet: any lookup into it and any format of it renders."""

    def __getitem__(self, _: object) -> _AnyItem:
        return self

    def __format__(self, _: str) -> str:
        return ""


def check_item_key(template: str, run_input: Mapping[str, Any], label: str) -> None:
    """Whether a map's key template can render for some item over ``run_input``:
    :class:`InputError` (as :func:`render_key`'s) when a run-input field it names is missing or
    cannot be looked into — the same for every item, so refused when the run is triggered
    rather than found at expansion. What depends on the item is judged per item, then."""
    render_key(template, {**run_input, "item": _AnyItem(), "index": 0}, label)
