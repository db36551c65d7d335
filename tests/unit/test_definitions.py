"""Workflow files: the SPEC 5.1 example, errors naming source and key path, folders."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowforge.definitions import (
    check_file,
    check_paths,
    load_paths,
    workflow_from_mapping,
)
from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.errors import DefinitionError


def load_file(path: Path) -> WorkflowDef:
    """The one workflow of ``path``, read the way the client reads a configured file; the
    first problem raises :class:`DefinitionError`."""
    [workflow] = load_paths([path]).values()
    return workflow


SPEC_WORKFLOW = """\
name: order-fulfilment
tasks:
  - name: charge
    handler: payments.charge
    retry: {max_attempts: 5, base_delay: 1, max_delay: 60, jitter: full}
    idempotency_key: "charge-{order_id}"        # formatted with the run input
    timeout: 30                                  # seconds
  - name: ship
    handler: shipping.ship
    depends_on: [charge]
    ordering_key: "customer-{customer_id}"
"""


def spec_mapping() -> dict[str, Any]:
    data = yaml.safe_load(SPEC_WORKFLOW)
    assert isinstance(data, dict)
    return data


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def simple(name: str, task: str = "a") -> str:
    return f"name: {name}\ntasks:\n  - name: {task}\n    handler: h.{task}\n"


def test_spec_workflow_example_is_parsed() -> None:
    w = workflow_from_mapping(spec_mapping(), "order.yaml")
    assert w.name == "order-fulfilment"
    assert w.fail_fast is True
    charge, ship = w.tasks
    assert charge == TaskDef(
        name="charge",
        handler="payments.charge",
        retry=RetryPolicy(max_attempts=5, base_delay=1.0, max_delay=60.0, jitter=Jitter.FULL),
        idempotency_key="charge-{order_id}",
        timeout=30.0,
    )
    assert isinstance(charge.timeout, float) and isinstance(charge.retry.base_delay, float)
    assert ship.depends_on == ("charge",)
    assert ship.ordering_key == "customer-{customer_id}"
    assert ship.retry == RetryPolicy()
    assert ship.timeout is None and ship.on_dead is OnDead.RELEASE


def test_depends_on_accepts_a_single_name() -> None:
    data = spec_mapping()
    data["tasks"][1]["depends_on"] = "charge"
    assert workflow_from_mapping(data).task("ship").depends_on == ("charge",)


def test_on_dead_and_fail_fast_are_read() -> None:
    data = spec_mapping()
    data["fail_fast"] = False
    data["tasks"][1]["on_dead"] = "block"
    w = workflow_from_mapping(data)
    assert w.fail_fast is False and w.task("ship").on_dead is OnDead.BLOCK


def test_to_dict_round_trips_through_workflow_from_mapping() -> None:
    w = workflow_from_mapping(spec_mapping())
    again = workflow_from_mapping(w.to_dict())
    assert again == w and again.digest == w.digest


def errors_for(data: Any, source: str = "wf.yaml") -> str:
    with pytest.raises(DefinitionError) as info:
        workflow_from_mapping(data, source)
    message = str(info.value)
    assert message.startswith(f"{source}: "), message
    assert "\n" not in message
    return message


def test_wrong_type_names_source_and_full_key_path() -> None:
    data = spec_mapping()
    data["tasks"][1]["retry"] = {"max_attempts": "five"}
    message = errors_for(data)
    assert "tasks[1].retry.max_attempts: expected an integer" in message


def test_invalid_retry_value_names_source_and_task_path() -> None:
    data = spec_mapping()
    data["tasks"][1]["retry"] = {"max_attempts": 0}
    message = errors_for(data)
    assert "tasks[1].retry" in message and "max_attempts" in message


def test_unknown_task_key_is_named_by_path() -> None:
    data = spec_mapping()
    data["tasks"][0]["retries"] = 3
    assert "tasks[0].retries: unknown key" in errors_for(data)


def test_unknown_top_level_key_is_named() -> None:
    data = {**spec_mapping(), "version": 2}
    assert "wf.yaml: version: unknown key" in errors_for(data)


def test_bad_jitter_lists_allowed_values() -> None:
    data = spec_mapping()
    data["tasks"][0]["retry"]["jitter"] = "some"
    message = errors_for(data)
    assert "tasks[0].retry.jitter" in message and "full" in message and "equal" in message


def test_missing_handler_is_named() -> None:
    data = spec_mapping()
    del data["tasks"][1]["handler"]
    assert "tasks[1].handler: required key is missing" in errors_for(data)


def test_tasks_not_a_list_is_refused() -> None:
    assert "tasks: expected a list" in errors_for({"name": "w", "tasks": {"a": 1}})


@pytest.mark.parametrize("data", [None, [], "name: x"])
def test_non_mapping_document_is_refused(data: Any) -> None:
    assert "expected a mapping" in errors_for(data)


def test_unknown_dependency_is_refused_with_source() -> None:
    data = spec_mapping()
    data["tasks"][1]["depends_on"] = ["chrage"]
    assert "unknown task 'chrage'" in errors_for(data)


def test_cycle_is_refused_with_source() -> None:
    data = spec_mapping()
    data["tasks"][0]["depends_on"] = ["ship"]
    assert "dependency cycle" in errors_for(data)


def test_bad_template_is_refused_with_task_path() -> None:
    data = spec_mapping()
    data["tasks"][0]["idempotency_key"] = "charge-{order.__class__}"
    message = errors_for(data)
    assert "tasks[0]" in message and "idempotency_key" in message


def test_load_file_reads_yaml_file(tmp_path: Path) -> None:
    path = write(tmp_path, "order.yaml", SPEC_WORKFLOW)
    assert load_file(path) == workflow_from_mapping(spec_mapping())


def test_load_file_reports_invalid_yaml_with_path_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.yaml", "name: x\ntasks: [unclosed\n")
    with pytest.raises(DefinitionError) as info:
        load_file(path)
    # the parser's reason and position, not just "not valid YAML"
    assert str(info.value).startswith(f"{path}:3:1: not valid YAML: expected ',' or ']'")


def test_load_file_errors_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.yaml", simple("w") + "    timeout: zero\n")
    with pytest.raises(DefinitionError, match=r"bad\.yaml:5: tasks\[0\]\.timeout"):
        load_file(path)


def test_load_paths_reads_folder_files_and_individual_files(tmp_path: Path) -> None:
    folder = tmp_path / "workflows"
    write(folder, "b.yaml", simple("beta"))
    write(folder, "a.yml", simple("alpha"))
    write(folder, "notes.txt", "not a workflow")
    write(folder / "nested", "c.yaml", simple("nested"))
    single = write(tmp_path, "single.yaml", simple("gamma"))
    found = load_paths([folder, single])
    assert list(found) == ["alpha", "beta", "gamma"]
    assert all(isinstance(w, WorkflowDef) for w in found.values())


def test_load_paths_refuses_duplicate_workflow_name_across_files(tmp_path: Path) -> None:
    write(tmp_path, "one.yaml", simple("same", "a"))
    write(tmp_path, "two.yaml", simple("same", "b"))
    with pytest.raises(DefinitionError) as info:
        load_paths([tmp_path])
    message = str(info.value)
    assert "'same'" in message and "one.yaml" in message and "two.yaml" in message


def test_load_paths_refuses_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DefinitionError, match="no such workflow file or folder") as info:
        load_paths([missing])
    assert str(missing) in str(info.value)


def test_load_paths_of_empty_folder_is_empty(tmp_path: Path) -> None:
    assert load_paths([tmp_path]) == {}


# ------------------------------------------------------------------ every problem, with its line

MANY_PROBLEMS = """\
name: many
tasks:
  - name: a
    handler: h.a
    timeout: soon
  - name: b
    handler: h.unknown
    retry: {max_attempts: 0.5, jitter: some}
    retries: 3
  - name: c
    handler: h.c
    handler: h.c2
"""


def test_check_file_reports_every_problem_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "many.yaml", MANY_PROBLEMS)
    workflow, problems = check_file(path, handlers={"h.a", "h.c", "h.c2"})
    assert workflow is None
    assert problems == [
        f"{path}:5: tasks[0].timeout: expected a number, got a string",
        f"{path}:7: tasks[1].handler: no configured handler module registers 'h.unknown'",
        f"{path}:8: tasks[1].retry.max_attempts: expected an integer, got float",
        f"{path}:8: tasks[1].retry.jitter: must be one of full, equal, none, got 'some'",
        f"{path}:9: tasks[1].retries: unknown key",
        f"{path}:12: duplicate key 'handler' (first at line 11)",
    ]


def test_a_duplicate_key_is_refused_even_when_the_rest_is_valid(tmp_path: Path) -> None:
    path = write(tmp_path, "dup.yaml", simple("w") + "name: w2\n")
    with pytest.raises(DefinitionError, match=r"dup\.yaml:5: duplicate key 'name' \(first at"):
        load_file(path)


def test_handler_names_are_checked_only_when_handlers_are_given(tmp_path: Path) -> None:
    path = write(tmp_path, "w.yaml", simple("w"))
    assert check_file(path)[1] == []
    assert check_file(path, handlers={"h.a"})[1] == []
    assert check_file(path, handlers=set())[1] == [
        f"{path}:4: tasks[0].handler: no configured handler module registers 'h.a'"
    ]


def test_check_paths_goes_on_past_a_bad_file(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "name: [\n")
    write(tmp_path, "b.yaml", simple("good"))
    write(tmp_path, "c.yaml", simple("good"))
    missing = tmp_path / "missing.yaml"
    found, problems = check_paths([tmp_path, missing])
    assert list(found) == ["good"]
    assert [p.split(": ", 1)[0] for p in problems] == [
        f"{tmp_path / 'a.yaml'}:2:1",
        f"{tmp_path / 'c.yaml'}",
        f"{missing}",
    ]
    assert "already defined in" in problems[1] and "no such workflow" in problems[2]
