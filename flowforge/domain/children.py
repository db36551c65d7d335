"""Sub-workflows (``workflow: <name>`` as a task, SPEC 7.3; docs/dynamic.md "Sub-workflows").

Pure: no I/O. A child-workflow task starts one child run per attempt; this module checks what
a definition says about its child (the ``input:`` mapping, the child workflow's existence, no
recursion among a set of workflows) and renders the child's input when the child starts.

The ``input:`` mapping is plain JSON whose string values may be key templates
(:func:`~flowforge.domain.keys.check_template`) over the parent run's input plus ``upstream``
(the results of the task's dependencies: ``{upstream[approve][amount]}``; ``upstream``
shadows a run-input key of that name). A string that is exactly one field (``"{order}"``)
takes the value it names with its JSON type (an object stays an object, a number a number);
any other template renders text, as a key template does.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from flowforge.errors import InputError

if TYPE_CHECKING:  # dag imports this module: only the type, at type-checking time
    from flowforge.domain.dag import WorkflowDef

#: Most levels of nesting of child runs: a root run is level 0, its children 1, ... A child
#: that would be deeper is not started (its task is DEAD ``child_depth_exceeded``): recursion
#: that only shows at run time (definitions registered from Python, replaced later) cannot
#: run away.
MAX_CHILD_DEPTH = 10
#: The name under which a child's ``input:`` templates reach the results of the task's
#: dependencies.
UPSTREAM = "upstream"
_FORMATTER = string.Formatter()


def template_strings(value: Any) -> Iterable[str]:
    """Every string inside a nested ``input:`` value (its templates, to check each)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from template_strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from template_strings(item)


def template_fields(value: Any) -> Iterable[tuple[str, str]]:
    """Every (string, field name) of the templates inside a nested ``input:`` value (each
    string parses: :func:`~flowforge.domain.keys.check_template` checked it first)."""
    for text in template_strings(value):
        for _, name, _, _ in _FORMATTER.parse(text):
            if name is not None:
                yield text, name


def upstream_named(field: str) -> str | None:
    """The dependency a field reaches through ``upstream`` (``upstream[approve][x]`` →
    ``approve``), '' for ``upstream`` alone, None for a field over the run input."""
    root, _, rest = field.partition("[")
    if root != UPSTREAM:
        return None
    return rest.partition("]")[0] if rest else ""


def render_input(
    template: Any, run_input: Mapping[str, Any], upstream: Mapping[str, Any], label: str
) -> Any:
    """The child's input from the ``input:`` template; :class:`InputError` names the string
    that cannot be rendered (a missing key or index, a lookup into a non-container)."""
    scope = {**run_input, UPSTREAM: upstream}
    return _render(template, scope, label)


def _render(value: Any, scope: Mapping[str, Any], label: str) -> Any:
    if isinstance(value, Mapping):
        return {k: _render(v, scope, label) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_render(v, scope, label) for v in value]
    if not isinstance(value, str):
        return value
    try:
        parsed = list(_FORMATTER.parse(value))
        if len(parsed) == 1:
            literal, field, spec, conversion = parsed[0]
            if literal == "" and field and spec == "" and conversion is None:
                return _FORMATTER.get_field(field, (), scope)[0]  # the value, its own type
        return value.format_map(scope)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{label}: cannot render {value!r}: {exc!r}") from exc


def unknown_children(workflows: Mapping[str, WorkflowDef]) -> list[tuple[str, str]]:
    """(workflow, problem) for each child-workflow task of ``workflows`` naming a workflow
    that is not among them, and for each workflow that recurses into itself, directly or
    through others (``a -> b -> a``; reported once per cycle, on its first workflow)."""
    problems: list[tuple[str, str]] = []
    for name, workflow in workflows.items():
        for task in workflow.tasks:
            if task.workflow is not None and task.workflow not in workflows:
                problems.append(
                    (
                        name,
                        f"task {task.name!r}: workflow {task.workflow!r} is not defined "
                        "(no loaded workflow has that name)",
                    )
                )
    from flowforge.domain.dag import find_cycle  # dag imports this module at load

    edges = {
        name: [t.workflow for t in w.tasks if t.workflow is not None and t.workflow in workflows]
        for name, w in workflows.items()
    }
    reported: set[str] = set()
    for name in sorted(edges):
        if name in reported:
            continue
        cycle = find_cycle({n: edges[n] for n in _reachable(edges, name)})
        if cycle and name in cycle:
            reported.update(cycle)
            problems.append((name, f"workflows recurse into themselves: {' -> '.join(cycle)}"))
    return problems


def _reachable(edges: Mapping[str, list[str]], start: str) -> list[str]:
    seen = [start]
    for name in seen:
        seen.extend(n for n in edges.get(name, ()) if n not in seen)
    return seen


def referenced(workflow: WorkflowDef, known: Mapping[str, WorkflowDef]) -> list[WorkflowDef]:
    """The workflows ``workflow`` starts as children, directly or through them, that are in
    ``known`` (a trigger registers their definitions with its run's)."""
    found: dict[str, WorkflowDef] = {}
    todo = [workflow]
    while todo:
        for task in todo.pop().tasks:
            child = known.get(task.workflow) if task.workflow is not None else None
            if child is not None and child.name not in found and child.name != workflow.name:
                found[child.name] = child
                todo.append(child)
    return list(found.values())
