"""Where a process finds its workflows: the config's ``workflows`` files and folders, and the
``workflow_modules`` that define them in Python (:class:`~flowforge.workflow.Workflow`).

A module is imported like a handler module (from the config's folder first) and each of its
module-level :class:`~flowforge.workflow.Workflow` or :class:`~flowforge.WorkflowDef` values is
a workflow; the same object reached from two modules counts once. Every process that reads
workflows (the client and so the CLI and the api, the scheduler) goes through
:func:`check_config`, so they all see the same ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path

from flowforge.config import Config
from flowforge.definitions import check_paths, raise_first, unregistered
from flowforge.domain.dag import WorkflowDef
from flowforge.errors import ConfigError, DefinitionError
from flowforge.handlers import import_module
from flowforge.workflow import Workflow


def check_config(
    config: Config,
    handlers: Collection[str] | None = None,
    paths: Iterable[Path] | None = None,
) -> tuple[dict[str, WorkflowDef], list[str]]:
    """Every valid workflow of ``config`` by name and every problem, one line each (see
    :func:`~flowforge.definitions.check_paths`). ``paths`` replaces the config's files and
    folders and its modules (``flowforge workflows validate PATHS``); ``handlers``, when given,
    are the handler names every task's handler must be among."""
    if paths is not None:
        return check_paths(paths, handlers)
    defined, problems = check_modules(config.workflow_modules, config.base_dir, handlers)
    found, more = check_paths(config.workflow_paths(), handlers, defined)
    return found, more + problems


def load_config_workflows(config: Config) -> dict[str, WorkflowDef]:
    """:func:`check_config`'s workflows; its first problem raises :class:`DefinitionError`."""
    found, problems = check_config(config)
    raise_first(problems)
    return found


def check_modules(
    modules: Iterable[str], search_path: str, handlers: Collection[str] | None = None
) -> tuple[list[tuple[str, WorkflowDef]], list[str]]:
    """The workflows ``modules`` define, each with where (``module NAME``), and every problem:
    a module that cannot be imported or defines none, a definition the checks refuse
    (``module NAME: workflow 'W': key.path: message``), a handler not among ``handlers``."""
    defined: list[tuple[str, WorkflowDef]] = []
    problems: list[str] = []
    seen: set[int] = set()  # ids of the objects found: one imported by another module too
    for name in modules:
        try:
            module = import_module(name, search_path, "workflow_modules")
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        where = f"module {name}"
        values = [v for v in vars(module).values() if isinstance(v, Workflow | WorkflowDef)]
        if not values:
            problems.append(f"workflow_modules: {name!r} defines no Workflow")
        for value in values:
            if id(value) in seen:
                continue
            seen.add(id(value))
            try:
                workflow = value.build() if isinstance(value, Workflow) else value
            except DefinitionError as exc:
                problems.append(f"{where}: {exc}")
                continue
            missing = [] if handlers is None else unregistered(workflow, handlers)
            problems += [f"{where}: workflow {workflow.name!r}: {line}" for line in missing]
            if not missing:
                defined.append((where, workflow))
    return defined, problems
