"""Build frozen dataclasses from plain mappings (parsed YAML/JSON), naming bad keys by path.

One mechanism serves the config file and workflow files alike: every field's type hint says
how to read it, unknown keys are refused, and a dataclass's own ``__post_init__`` checks
(``ValueError`` or a FlowForge error) are reported with the path of the offending section.
Every problem of a document is collected, not just the first: :attr:`SchemaError.errors`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, TypeVar

from flowforge.errors import FlowForgeError

T = TypeVar("T")

#: Field metadata marking a value the loader fills in (a secret read from a file, say): a
#: document may not set it, and a key of that name is refused as unknown.
DERIVED = {"derived": True}


class SchemaError(ValueError):
    """Values that do not fit their declared types.

    ``errors`` holds every problem found as ``(key path, message)``; ``str()`` is the first,
    as ``path: message``, followed by how many more there are.
    """

    def __init__(self, path: str, message: str | None = None) -> None:
        self.errors: list[tuple[str, str]] = [] if message is None else [(path, message)]
        super().__init__()

    @classmethod
    def of(cls, errors: list[tuple[str, str]]) -> SchemaError:
        exc = cls("")
        exc.errors = errors
        return exc

    @staticmethod
    def line(path: str, message: str) -> str:
        return f"{path}: {message}" if path else message

    def __str__(self) -> str:
        if not self.errors:
            return "invalid"
        first = self.line(*self.errors[0])
        more = len(self.errors) - 1
        return f"{first} (and {more} more)" if more else first


def build(cls: type[T], data: Any, path: str) -> T:
    """Instantiate dataclass ``cls`` from ``data``; raise :class:`SchemaError` naming ``path``."""
    if not isinstance(data, Mapping):
        raise SchemaError(path, f"expected a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: f
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if not f.metadata.get("derived")
    }
    errors = [(_join(path, str(k)), "unknown key") for k in data if k not in fields]
    kwargs: dict[str, Any] = {}
    for name, spec in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(hints[name], data[name], _join(path, name))
            except SchemaError as exc:
                errors.extend(exc.errors)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            errors.append((_join(path, name), "required key is missing"))
    if errors:
        raise SchemaError.of(errors)
    try:
        return cls(**kwargs)
    except (ValueError, FlowForgeError) as exc:
        if isinstance(exc, SchemaError):
            raise
        # an error that names the field it is about (``key`` and ``detail``) is reported at
        # that field's path, so the line number is the field's own
        key, detail = getattr(exc, "key", None), getattr(exc, "detail", None)
        if isinstance(key, str) and key and isinstance(detail, str):
            raise SchemaError(_join(path, key), detail) from exc
        raise SchemaError(path, str(exc)) from exc


_SCALARS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _convert_optional(hint, value, path)
    if origin is tuple:
        return _convert_tuple(hint, value, path)
    if origin in (dict, Mapping):
        return _convert_mapping(value, path)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)  # type: ignore[arg-type]
    if isinstance(hint, type) and issubclass(hint, Enum):
        allowed = [str(m.value) for m in hint]
        if value not in allowed:
            raise SchemaError(path, f"must be one of {', '.join(allowed)}, got {value!r}")
        return hint(value)
    if hint in _SCALARS:
        return _convert_scalar(hint, value, path)
    raise TypeError(f"{path}: unsupported field type {hint!r}")


def _convert_scalar(hint: type, value: Any, path: str) -> Any:
    accepts, expected = _SCALARS[hint]
    if not accepts(value):
        raise SchemaError(path, f"expected {expected}, got {_kind(value)}")
    if hint is float and not math.isfinite(value):
        raise SchemaError(path, f"must be a finite number, got {value!r}")
    if hint is str:
        _check_str(value, path)
    return float(value) if hint is float else value


def _convert_optional(hint: Any, value: Any, path: str) -> Any:
    options = typing.get_args(hint)
    if value is None and type(None) in options:
        return None
    (inner,) = [o for o in options if o is not type(None)]
    return _convert(inner, value, path)


def _convert_tuple(hint: Any, value: Any, path: str) -> tuple[Any, ...]:
    inner = typing.get_args(hint)[0]
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise SchemaError(path, f"expected a list, got {_kind(value)}")
    items, errors = [], []
    for i, v in enumerate(value):
        try:
            items.append(_convert(inner, v, f"{path}[{i}]"))
        except SchemaError as exc:
            errors.extend(exc.errors)
    if errors:
        raise SchemaError.of(errors)
    return tuple(items)


def _check_str(value: str, path: str) -> None:
    """Refuse text no setting can hold: a NUL byte (C libraries such as libpq would cut the
    string there and use what is left) or a lone surrogate (not encodable as UTF-8, so no
    file, URL or statement can carry it). The message never repeats the value: it may be a
    secret."""
    if "\x00" in value:
        raise SchemaError(path, "holds a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(path, "holds a lone surrogate (not UTF-8 text)") from None


def _convert_mapping(value: Any, path: str) -> dict[str, Any]:
    """A mapping with string keys, its values as given (plain data: checked by the caller)."""
    if not isinstance(value, Mapping):
        raise SchemaError(path, f"expected a mapping, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise SchemaError(path, f"keys must be strings, got {_kind(key)} {key!r}")
    return dict(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )
