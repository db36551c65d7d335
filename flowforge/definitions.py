"""Loading workflow definitions from YAML files (or folders of them).

The YAML shape is the one of SPEC 5.1; it is read with the same schema builder as the config,
so an unknown key or a bad value is reported with the file and the key path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from flowforge.domain.dag import WorkflowDef
from flowforge.errors import DefinitionError
from flowforge.schema import SchemaError, build

YAML_SUFFIXES = (".yaml", ".yml")


def workflow_from_mapping(data: Any, source: str = "workflow") -> WorkflowDef:
    """A validated :class:`WorkflowDef` from parsed YAML/JSON; errors name ``source``."""
    if isinstance(data, Mapping) and isinstance(data.get("tasks"), list):
        data = {**data, "tasks": [_normalise_task(t) for t in data["tasks"]]}
    try:
        return build(WorkflowDef, data, "")
    except SchemaError as exc:
        raise DefinitionError(f"{source}: {str(exc).lstrip(': ')}") from exc


def _normalise_task(task: Any) -> Any:
    """Accept ``depends_on: name`` as shorthand for a one-element list."""
    if isinstance(task, Mapping) and isinstance(task.get("depends_on"), str):
        return {**task, "depends_on": [task["depends_on"]]}
    return task


def load_file(path: Path) -> WorkflowDef:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DefinitionError(f"{path}: cannot read workflow file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise DefinitionError(f"{path}: not valid YAML{at}") from exc
    return workflow_from_mapping(data, str(path))


def load_paths(paths: Iterable[Path]) -> dict[str, WorkflowDef]:
    """Every workflow in the given files and folders (``*.yaml``/``*.yml``, sorted), by name.

    Two files defining the same workflow name are refused.
    """
    found: dict[str, tuple[WorkflowDef, Path]] = {}
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())
        elif path.exists():
            files = [path]
        else:
            raise DefinitionError(f"{path}: no such workflow file or folder")
        for file in files:
            workflow = load_file(file)
            if workflow.name in found:
                raise DefinitionError(
                    f"{file}: workflow {workflow.name!r} is already defined in "
                    f"{found[workflow.name][1]}"
                )
            found[workflow.name] = (workflow, file)
    return {name: wf for name, (wf, _) in found.items()}
