"""Bad definitions of issue 19's constructs, class by class (tests/bad_dynamic.py), through
the two paths that need no database: Python's ``TaskDef``/``WorkflowDef``/``EventWait`` and a
workflow file read as ``flowforge workflows validate`` reads it. Each is one
:class:`DefinitionError` line naming the field, never another exception."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowforge.definitions import check_file, workflow_from_mapping
from flowforge.domain.dag import TaskDef
from flowforge.errors import DefinitionError
from tests.bad_dynamic import BAD_FILES, BAD_PYTHON, FILE


@pytest.mark.parametrize(("build", "fragment"), BAD_PYTHON)
def test_a_bad_python_definition_is_one_definition_error_naming_it(
    build: Callable[[], Any], fragment: str
) -> None:
    with pytest.raises(DefinitionError) as caught:
        build()
    message = str(caught.value)
    assert fragment in message and "\n" not in message, message


@pytest.mark.parametrize(("process", "top", "fragment"), BAD_FILES)
def test_a_bad_workflow_file_is_one_problem_on_one_line_naming_it(
    tmp_path: Path, process: str, top: str, fragment: str
) -> None:
    path = tmp_path / "etl.yaml"
    path.write_text(FILE.format(process=process, top=top))
    workflow, problems = check_file(path)
    assert workflow is None
    assert len(problems) == 1, problems
    assert fragment in problems[0] and "\n" not in problems[0], problems[0]
    assert problems[0].startswith(f"{path}:"), problems[0]


def test_the_file_template_is_valid_with_a_good_map() -> None:
    """The cases above fail for their bad value, not for the template around it."""
    text = FILE.format(
        process="handler: h.p, for_each: list, max_parallel: 2", top="max_items: 5\n"
    )
    workflow = workflow_from_mapping(yaml.safe_load(text))
    assert workflow.task("process").for_each == "list" and workflow.max_items == 5


def test_a_python_list_of_dependencies_still_gets_the_maps_upstream() -> None:
    """``depends_on=[]`` (a list, as in YAML) once left a map without a dependency on what
    it maps over (nothing would have held it until its upstream ran). It is read as a tuple
    now, and the upstream added to it."""
    task = TaskDef("process", "h.p", for_each="list", depends_on=[])  # type: ignore[arg-type]
    assert task.depends_on == ("list",)
    listed = TaskDef("process", "h.p", for_each="list", depends_on=["other"])  # type: ignore[arg-type]
    assert listed.depends_on == ("other", "list")
