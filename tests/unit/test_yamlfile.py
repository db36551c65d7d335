"""The one reader of YAML files (flowforge/yamlfile.py ``read``): the config and the workflow
files say the same thing about the same broken file, because both go through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowforge.config import load_config
from flowforge.definitions import check_file
from flowforge.errors import ConfigError
from flowforge.yamlfile import YamlFileError, read


def _config_problem(path: Path) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={})
    return str(raised.value)


def _workflow_problem(path: Path) -> str:
    workflow, problems = check_file(path)
    assert workflow is None and len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"a: [1,\nb: 2\n", ":3:1: not valid YAML: expected ',' or ']'"),
        (b"a: \xff\n", ": cannot read {what}: not UTF-8 text"),
        (None, ": cannot read {what}: No such file or directory"),
    ],
    ids=["syntax", "not-utf8", "missing"],
)
def test_config_and_workflow_files_are_read_by_one_reader(
    tmp_path: Path, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "broken.yaml"
    if content is not None:
        path.write_bytes(content)
    for what, problem in (
        ("config file", _config_problem(path)),
        ("workflow file", _workflow_problem(path)),
    ):
        assert problem.startswith(str(path) + expected.format(what=what)), problem
        with pytest.raises(YamlFileError) as raised:
            read(path, what)
        assert str(raised.value) == problem
        assert "\n" not in problem


def test_read_leaves_duplicate_keys_for_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("a: 1\nb: 2\na: 3\n")
    doc = read(path, "config file")
    assert doc.data == {"a": 3, "b": 2}
    assert doc.duplicates == ((3, "duplicate key 'a' (first at line 1)"),)
