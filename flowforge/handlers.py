"""Declaring handlers: ``@flowforge.task("name")``.

The decorator only *marks* a function; nothing is registered globally. A worker builds its
registry by importing the modules its config lists and collecting marked functions, so only
those handlers can ever run and a message never names code to import.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from flowforge.domain.names import NAME_PATTERN
from flowforge.errors import ConfigError, DefinitionError

MARK = "__flowforge_task__"
F = TypeVar("F", bound=Callable[..., Any])


def task(name: str) -> Callable[[F], F]:
    """Mark ``fn`` as the handler called ``name`` (a function taking the task context)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise DefinitionError(f"handler name {name!r} is invalid")

    def mark(fn: F) -> F:
        setattr(fn, MARK, name)
        return fn

    return mark


def collect(
    modules: Iterable[str], search_path: str | None = None
) -> Mapping[str, Callable[..., Any]]:
    """Import ``modules`` and return their marked handlers by name.

    ``search_path`` (the config's directory) is put first on ``sys.path`` so a config folder
    can ship its handler modules. A module that cannot be imported, or two handlers with one
    name, raise :class:`ConfigError`.
    """
    if search_path and search_path not in sys.path:
        sys.path.insert(0, str(Path(search_path)))
    found: dict[str, Callable[..., Any]] = {}
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # any import-time failure is the operator's to fix
            raise ConfigError(f"handlers: cannot import {module_name!r}: {exc!r}") from exc
        for _, fn in inspect.getmembers(module, callable):
            name = getattr(fn, MARK, None)
            if name is None:
                continue
            if name in found and found[name] is not fn:
                raise ConfigError(f"handlers: two handlers are named {name!r}")
            found[name] = fn
    return MappingProxyType(found)
