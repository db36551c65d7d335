"""How a process finds Python-defined workflows: ``workflow_modules`` of the config, beside
its workflow files, through one function every reader of workflows calls (client, CLI, api,
scheduler): ``flowforge/discovery.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowforge.client import Client
from flowforge.config import Config
from flowforge.discovery import check_config, load_config_workflows
from flowforge.errors import DefinitionError
from tests.modules import module_dir, unique, write_module

__all__ = ["module_dir"]  # a fixture: used by name

FLOWS = """
from flowforge import Workflow, WorkflowDef, TaskDef, task

shipping = Workflow("shipping")
shipping.task("pack", "shop.pack")

@shipping.step(depends_on=["pack"])
def notify(ctx):
    return "sent"

plain = WorkflowDef("plain", (TaskDef("one", "shop.one"),))
ALIAS = shipping  # the same object twice: one workflow
"""


def config(folder: Path, *modules: str, workflows: tuple[str, ...] = ()) -> Config:
    return Config(base_dir=str(folder), workflow_modules=modules, workflows=workflows)


def test_a_modules_workflows_are_found_by_the_config(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    found, problems = check_config(config(module_dir, name))
    assert problems == []
    assert sorted(found) == ["plain", "shipping"]
    assert [t.handler for t in found["shipping"].tasks] == ["shop.pack", "shipping.notify"]


def test_the_client_sees_python_and_file_workflows_alike(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    (module_dir / "wf").mkdir()
    (module_dir / "wf" / "hello.yaml").write_text("name: hello\ntasks: [{name: a, handler: h}]\n")
    client = Client(config(module_dir, name, workflows=("wf",)))
    assert sorted(client.workflows) == ["hello", "plain", "shipping"]


def test_handler_names_are_checked_for_python_workflows_too(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    found, problems = check_config(config(module_dir, name), handlers={"shop.pack", "shop.one"})
    assert problems == [
        f"module {name}: workflow 'shipping': tasks[1].handler: no configured handler module "
        "registers 'shipping.notify'"
    ]
    assert list(found) == ["plain"]


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (
            "raise RuntimeError('boom')",
            "workflow_modules: cannot import '{name}': RuntimeError('boom')",
        ),
        ("X = 1", "workflow_modules: '{name}' defines no Workflow"),
        (
            "from flowforge import Workflow\nw = Workflow('w')\n"
            "w.task('a', 'h', retry={'max_attempts': 0})",
            "module {name}: workflow 'w': tasks[0].retry: max_attempts must be at least 1",
        ),
        (
            "from flowforge import Workflow\nw = Workflow('w')\nw.task('a', workflow='nowhere')",
            "module {name}: workflow 'w': task 'a': workflow 'nowhere' is not defined "
            "(no loaded workflow has that name)",
        ),
    ],
    ids=["import fails", "no workflow", "invalid", "unknown child"],
)
def test_each_module_problem_is_one_line_naming_the_module(
    module_dir: Path, source: str, problem: str
) -> None:
    name = unique("flows")
    write_module(module_dir, name, source)
    found, problems = check_config(config(module_dir, name))
    assert found == {}
    assert problems == [problem.format(name=name)]
    with pytest.raises(DefinitionError):  # a client refuses to work on a broken set
        load_config_workflows(config(module_dir, name))


def test_a_missing_module_is_a_problem_not_a_crash(module_dir: Path) -> None:
    name = unique("absent")
    found, problems = check_config(config(module_dir, name))
    assert found == {}
    assert problems == [
        f'workflow_modules: cannot import {name!r}: ModuleNotFoundError("No module named '
        f"'{name}'\")"
    ]


def test_a_name_defined_in_a_file_and_a_module_is_a_problem_of_the_module(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    (module_dir / "wf").mkdir()
    (module_dir / "wf" / "s.yaml").write_text("name: shipping\ntasks: [{name: a, handler: h}]\n")
    found, problems = check_config(config(module_dir, name, workflows=("wf",)))
    assert problems == [
        f"module {name}: workflow 'shipping' is already defined in {module_dir / 'wf' / 's.yaml'}"
    ]
    assert found["shipping"].tasks[0].name == "a"  # the file's


def test_two_modules_defining_one_name_and_one_object_reached_twice(module_dir: Path) -> None:
    first, second, third = unique("a"), unique("b"), unique("c")
    write_module(module_dir, first, FLOWS)
    write_module(module_dir, second, f"from {first} import shipping\n")  # the same object
    write_module(
        module_dir,
        third,
        "from flowforge import Workflow\nw = Workflow('plain')\nw.task('x', 'h')\n",
    )
    found, problems = check_config(config(module_dir, first, second, third))
    assert sorted(found) == ["plain", "shipping"]
    assert problems == [f"module {third}: workflow 'plain' is already defined in module {first}"]


def test_a_schedule_name_used_by_a_file_and_a_module_is_refused(module_dir: Path) -> None:
    name = unique("flows")
    write_module(
        module_dir,
        name,
        "from flowforge import Workflow\nw = Workflow('py')\nw.task('a', 'h')\n"
        "w.schedule(every='1m', name='nightly')\n",
    )
    (module_dir / "f.yaml").write_text(
        "name: f\ntasks: [{name: a, handler: h}]\nschedules: [{every: 1m, name: nightly}]\n"
    )
    found, problems = check_config(config(module_dir, name, workflows=("f.yaml",)))
    assert list(found) == ["f"]
    assert problems == [
        f"module {name}: schedule name 'nightly' is already used in {module_dir / 'f.yaml'}"
    ]


def test_paths_given_replace_the_configs_files_and_modules(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    (module_dir / "only.yaml").write_text("name: only\ntasks: [{name: a, handler: h}]\n")
    found, problems = check_config(config(module_dir, name), paths=[module_dir / "only.yaml"])
    assert (list(found), problems) == (["only"], [])


def test_a_builder_can_be_a_child_of_a_file_workflow(module_dir: Path) -> None:
    name = unique("flows")
    write_module(module_dir, name, FLOWS)
    (module_dir / "parent.yaml").write_text(
        "name: parent\ntasks: [{name: ship, workflow: shipping}]\n"
    )
    found, problems = check_config(config(module_dir, name, workflows=("parent.yaml",)))
    assert problems == [] and "parent" in found
