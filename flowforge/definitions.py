"""Loading workflow definitions from YAML files (or folders of them).

The YAML shape is the one of SPEC 5.1; it is read with the same schema builder and the same
YAML loader (duplicate keys refused) as the config, so an unknown key or a bad value is
reported with the file, the line and the key path. :func:`check_paths` finds every problem of
every file, one line each (``flowforge workflows validate``); the loaders raise the first.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from flowforge.domain.children import unknown_children
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.schedule import ScheduleDef
from flowforge.durations import parse_duration
from flowforge.errors import DefinitionError
from flowforge.schema import SchemaError, build
from flowforge.yamlfile import Document, YamlFileError, read

YAML_SUFFIXES = (".yaml", ".yml")


def workflow_from_mapping(data: Any, source: str = "workflow") -> WorkflowDef:
    """A validated :class:`WorkflowDef` from parsed YAML/JSON; errors name ``source``."""
    try:
        return _build(data)
    except SchemaError as exc:
        raise DefinitionError(f"{source}: {exc}") from exc


def _build(data: Any) -> WorkflowDef:
    errors: list[tuple[str, str]] = []
    if isinstance(data, Mapping):
        data = _seconds(data, "deadline", "", errors)
        if isinstance(data.get("tasks"), list):
            tasks = [
                _wait_seconds(
                    _seconds(_normalise_task(t), "sleep", f"tasks[{i}]", errors), i, errors
                )
                for i, t in enumerate(data["tasks"])
            ]
            errors += [
                (
                    f"tasks[{i}].handler",
                    "required key is missing (or give sleep: for a timer, wait_for_event: to "
                    "wait for an event, workflow: to start a child run)",
                )
                for i, t in enumerate(tasks)
                if isinstance(t, Mapping)
                and "handler" not in t
                and "sleep" not in t
                and "wait_for_event" not in t
                and "workflow" not in t
            ]
            data = {**data, "tasks": tasks}
    if errors:
        raise SchemaError.of(errors)
    return build(WorkflowDef, data, "")


def _normalise_task(task: Any) -> Any:
    """Accept ``depends_on: name`` as shorthand for a one-element list."""
    if isinstance(task, Mapping) and isinstance(task.get("depends_on"), str):
        return {**task, "depends_on": [task["depends_on"]]}
    return task


def _wait_seconds(task: Any, index: int, errors: list[tuple[str, str]]) -> Any:
    """``task`` with its ``wait_for_event.timeout``, ``rate_limit.per`` and
    ``circuit_breaker.window`` and ``cooldown`` written as text (``1d``, ``60s``) in seconds."""
    if not isinstance(task, Mapping):
        return task
    fields = (
        ("wait_for_event", "timeout"),
        ("rate_limit", "per"),
        ("circuit_breaker", "window"),
        ("circuit_breaker", "cooldown"),
    )
    for key, field in fields:
        if isinstance(task.get(key), Mapping):
            task = {**task, key: _seconds(task[key], field, f"tasks[{index}].{key}", errors)}
    return task


def _seconds(data: Any, key: str, path: str, errors: list[tuple[str, str]]) -> Any:
    """``data`` with a duration written as text (``sleep: 10m``, ``deadline: 2h``) turned into
    seconds (a number stays a number of seconds); a bad one is added to ``errors``."""
    if not isinstance(data, Mapping) or not isinstance(data.get(key), str):
        return data
    try:
        return {**data, key: parse_duration(data[key])}
    except ValueError as exc:
        errors.append((f"{path}.{key}" if path else key, str(exc)))
        return data


def check_file(
    path: Path, handlers: Collection[str] | None = None
) -> tuple[WorkflowDef | None, list[str]]:
    """The workflow in ``path`` (None if it has a problem) and every problem found in it.

    Each problem is one line, ``file:line: key.path: message`` where a line is known.
    ``handlers``, when given, are the registered handler names every task's handler must be
    among (a worker of this config could run no other).
    """
    try:
        doc = read(path, "workflow file")
    except YamlFileError as exc:
        return None, [str(exc)]
    found: list[tuple[int, str]] = list(doc.duplicates)
    if handlers is not None:
        found += _located(doc, _unregistered(doc.data, handlers))
    workflow: WorkflowDef | None = None
    try:
        workflow = _build(doc.data)
    except SchemaError as exc:
        found += _located(doc, exc.errors)
    problems = [f"{path}:{line}: {message}" for line, message in sorted(found, key=_line)]
    return (None if problems else workflow), problems


def _line(problem: tuple[int, str]) -> int:
    return problem[0]


def _located(doc: Document, errors: Iterable[tuple[str, str]]) -> list[tuple[int, str]]:
    return [(doc.line_of(key) or 1, SchemaError.line(key, message)) for key, message in errors]


def unregistered(workflow: WorkflowDef, handlers: Collection[str]) -> list[str]:
    """``key.path: message`` for each task of ``workflow`` whose handler is not among
    ``handlers`` (what :func:`check_file` says of a file's)."""
    return [SchemaError.line(*found) for found in _unregistered(workflow.to_dict(), handlers)]


def _unregistered(data: Any, handlers: Collection[str]) -> list[tuple[str, str]]:
    tasks = data.get("tasks") if isinstance(data, Mapping) else None
    if not isinstance(tasks, list):
        return []
    return [
        (f"tasks[{i}].handler", f"no configured handler module registers {task['handler']!r}")
        for i, task in enumerate(tasks)
        if isinstance(task, Mapping)
        and isinstance(task.get("handler"), str)
        and task["handler"] not in handlers
    ]


def check_paths(
    paths: Iterable[Path],
    handlers: Collection[str] | None = None,
    defined: Iterable[tuple[str, WorkflowDef]] = (),
) -> tuple[dict[str, WorkflowDef], list[str]]:
    """Every valid workflow in the given files and folders (``*.yaml``/``*.yml``, sorted) and
    ``defined`` elsewhere (Python: ``(where, workflow)``, after the files) by name, and every
    problem of every file (see :func:`check_file`), in that order.

    Two definitions of the same workflow name, or the same schedule name, are a problem of
    the second.
    """
    found: dict[str, tuple[WorkflowDef, str]] = {}
    schedules: dict[str, str] = {}  # schedule names are global (the schedules table's key)
    problems: list[str] = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())
        elif path.exists():
            files = [path]
        else:
            problems.append(f"{path}: no such workflow file or folder")
            continue
        for file in files:
            workflow, more = check_file(file, handlers)
            problems += more
            if workflow is not None:
                problems += _add(str(file), workflow, found, schedules)
    for where, workflow in defined:
        problems += _add(where, workflow, found, schedules)
    # across definitions: a child workflow must be one of them, none may recurse into itself
    loaded = {name: wf for name, (wf, _) in found.items()}
    for name, problem in unknown_children(loaded):
        problems.append(f"{found[name][1]}: workflow {name!r}: {problem}")
        loaded.pop(name, None)
    return loaded, problems


def _add(
    where: str,
    workflow: WorkflowDef,
    found: dict[str, tuple[WorkflowDef, str]],
    schedules: dict[str, str],
) -> list[str]:
    """Add ``workflow`` (defined in ``where``) to ``found`` and its schedule names to
    ``schedules``, or say why not: its name or a schedule name is taken."""
    if workflow.name in found:
        return [
            f"{where}: workflow {workflow.name!r} is already defined in {found[workflow.name][1]}"
        ]
    taken = [n for n, _ in workflow.named_schedules() if n in schedules]
    if taken:
        return [f"{where}: schedule name {taken[0]!r} is already used in {schedules[taken[0]]}"]
    schedules.update((n, where) for n, _ in workflow.named_schedules())
    found[workflow.name] = (workflow, where)
    return []


def load_paths(paths: Iterable[Path]) -> dict[str, WorkflowDef]:
    """Every workflow in the given files and folders, by name; the first problem raises
    :class:`DefinitionError` (``flowforge workflows validate`` lists them all)."""
    found, problems = check_paths(paths)
    raise_first(problems)
    return found


def raise_first(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DefinitionError(problems[0] + more)


def document(workflow: WorkflowDef) -> dict[str, Any]:
    """``workflow`` as a workflow file holds it, loading back (:func:`workflow_from_mapping`)
    to an equal definition of the same digest: its canonical form (:meth:`WorkflowDef.to_dict`)
    without the keys at their default, then its schedules."""
    canonical = workflow.to_dict()
    head = ("name", "fail_fast", "deadline", "max_items")  # before the tasks, as a file has them
    data: dict[str, Any] = {k: canonical[k] for k in head if k in canonical}
    if workflow.fail_fast:  # the default
        del data["fail_fast"]
    task_defaults, schedule_defaults = _defaults()
    data["tasks"] = [_changed(task, task_defaults) for task in canonical["tasks"]]
    if workflow.schedules:
        data["schedules"] = [
            _changed({"name": s.name, **s.to_spec()}, schedule_defaults) for s in workflow.schedules
        ]
    plain: dict[str, Any] = json.loads(json.dumps(data))  # tuples and mappings as YAML's own
    return plain


def export_yaml(workflow: WorkflowDef) -> str:
    """:func:`document` as YAML text, after a comment naming the digest (``flowforge
    workflows export``). Anything but printable ASCII is written as an escape, so the text is
    safe for a terminal whatever the definition holds."""
    import yaml  # not at import: the supervisor imports this module (flowforge/yamlfile.py)

    body = yaml.safe_dump(document(workflow), sort_keys=False, allow_unicode=False, width=100)
    return f"# workflow {workflow.name}, digest {workflow.digest}\n{body}"


def _changed(data: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in defaults or defaults[k] != v}


@functools.cache
def _defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """The keys a default handler task's canonical form has (``retry``, ``timeout``,
    ``on_dead``, ...) and those of a default schedule's, with their values: what
    :func:`document` leaves out."""
    task = WorkflowDef("w", (TaskDef("t", "h"),)).to_dict()["tasks"][0]
    schedule = {"name": None, **ScheduleDef(every="1s").to_spec()}
    return (
        {k: v for k, v in task.items() if k not in ("name", "handler")},
        {k: v for k, v in schedule.items() if k != "every"},
    )


def pool_problems(
    workflows: Mapping[str, WorkflowDef],
    default_queue: str,
    pools: Mapping[str, tuple[str, Collection[str]]],
) -> list[str]:
    """Every task of ``workflows`` whose queue (its own, else ``default_queue``) a pool of
    this tree consumes but whose handler that pool does not import: its workers could only
    bury it ``unknown_handler``. ``pools``: queue → (the pool's label, its handler names). A
    queue no pool here consumes is another tree's to serve, and not judged."""
    problems = []
    for workflow in workflows.values():
        for task in workflow.tasks:
            if not task.handler:  # a timer or an event wait: no worker runs it
                continue
            queue = task.queue or default_queue
            pool = pools.get(queue)
            if pool is not None and task.handler not in pool[1]:
                problems.append(
                    f"workflow {workflow.name!r} task {task.name!r}: handler {task.handler!r}"
                    f" goes to queue {queue!r}, whose pool ({pool[0]}) does not import it"
                )
    return problems
