"""Where a :class:`~flowforge.testing.LocalRunner` takes its workflows and handlers from:
definitions or YAML files, and module names, modules or mappings of stand-ins."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from flowforge.definitions import load_paths
from flowforge.domain.dag import WorkflowDef
from flowforge.errors import DefinitionError
from flowforge.handlers import collect
from flowforge.roles.context import TaskContext

Handler = Callable[[TaskContext], Any]
WorkflowSource = WorkflowDef | str | Path


def load_workflows(given: WorkflowSource | Iterable[WorkflowSource]) -> dict[str, WorkflowDef]:
    """Every workflow of ``given`` by name (files validated as ``workflows validate`` does);
    :class:`~flowforge.errors.DefinitionError` for one name defined two ways."""
    sources: list[WorkflowSource] = (
        [given] if isinstance(given, WorkflowDef | str | Path) else list(given)
    )
    found: dict[str, WorkflowDef] = {}
    for source in sources:
        loaded = (
            {source.name: source} if isinstance(source, WorkflowDef) else load_paths([Path(source)])
        )
        for name, workflow in loaded.items():
            if found.get(name, workflow) != workflow:
                raise DefinitionError(f"workflow {name!r} is defined twice")
            found[name] = workflow
    return found


def load_handlers(
    given: Mapping[str, Handler] | Iterable[str | ModuleType | Mapping[str, Handler]],
    search_path: str | Path | None,
) -> Mapping[str, Handler]:
    """Handlers by name, later sources winning: module names are imported as a worker
    imports ``handlers:`` (``search_path`` first on ``sys.path``), modules collected alike."""
    sources = [given] if isinstance(given, Mapping) else list(given)
    found: dict[str, Handler] = {}
    for source in sources:
        if isinstance(source, Mapping):
            found.update(source)
        else:
            name = source.__name__ if isinstance(source, ModuleType) else source
            found.update(collect([name], None if search_path is None else str(search_path)))
    return MappingProxyType(found)
