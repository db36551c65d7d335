"""docs/failure-model.md names tests; every one of them must exist, so the document cannot drift."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "failure-model.md"
#: "`test_x` (area/name)" names the test test_x in tests/area/test_name.py
REFERENCE = re.compile(r"`(test_[a-z0-9_]+)` \(([a-z]+)/([a-z0-9_]+)\)")
ANY_TEST_NAME = re.compile(r"\btest_[a-z0-9_]+\b")


@functools.cache  # the document names few files many times: parse each file once
def defined_tests(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    )


def test_every_test_the_failure_model_names_exists() -> None:
    references = REFERENCE.findall(DOC.read_text())
    assert len(references) > 50, "the document should name the tests that prove it"
    missing = []
    for name, area, stem in references:
        path = REPO / "tests" / area / f"test_{stem}.py"
        if not path.exists() or name not in defined_tests(path):
            missing.append(f"{name} ({area}/{stem})")
    assert not missing, f"docs/failure-model.md names tests that do not exist: {missing}"


def test_every_test_name_in_the_document_comes_with_its_file() -> None:
    text = DOC.read_text()
    referenced = {name for name, _, _ in REFERENCE.findall(text)}
    bare = set(ANY_TEST_NAME.findall(text)) - referenced
    assert not bare, f"name these with their file, as `test_x` (area/name): {sorted(bare)}"


def test_every_mode_without_a_test_says_unverified() -> None:
    sections = re.split(r"\n## ", DOC.read_text())
    numbered = [s for s in sections[1:] if re.match(r"\d+\.", s)]
    assert len(numbered) >= 30
    for section in numbered:
        assert REFERENCE.search(section) or "UNVERIFIED" in section, section.splitlines()[0]
