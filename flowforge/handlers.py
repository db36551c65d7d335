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
from types import MappingProxyType, ModuleType
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


def import_module(name: str, search_path: str | None, key: str) -> ModuleType:
    """Import module ``name`` with ``search_path`` (the config's folder) first on ``sys.path``,
    so a config folder can ship its modules; any failure raises :class:`ConfigError` naming
    the config ``key`` that lists it."""
    if search_path and search_path not in sys.path:
        sys.path.insert(0, str(Path(search_path)))
    try:
        return importlib.import_module(name)
    except Exception as exc:  # any import-time failure is the operator's to fix
        raise ConfigError(f"{key}: cannot import {name!r}: {exc!r}") from exc


def collect(
    modules: Iterable[str], search_path: str | None = None
) -> Mapping[str, Callable[..., Any]]:
    """Import ``modules`` and return their marked handlers by name.

    ``search_path`` (the config's directory) is put first on ``sys.path`` so a config folder
    can ship its handler modules. A module that cannot be imported, or two handlers with one
    name, raise :class:`ConfigError`.
    """
    found: dict[str, Callable[..., Any]] = {}
    for module_name in modules:
        module = import_module(module_name, search_path, "handlers")
        for _, fn in inspect.getmembers(module, callable):
            name = getattr(fn, MARK, None)
            if name is None:
                continue
            if name in found and found[name] is not fn:
                raise ConfigError(f"handlers: two handlers are named {name!r}")
            found[name] = fn
    return MappingProxyType(found)
