"""The product never depends on the developer harness, and the harness finds its checkout.

The wheel-level proof (built, listed, imported alone) is tests/integration/test_packaging.py
(``slow``); these are the fast checks of the same boundary on the source tree.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.harness import CHECKOUT, services

PRODUCT = ("flowforge", "supervisor")


def imported_roots(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path`` (at any depth of the module)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_product_module_imports_the_tests_or_their_harness() -> None:
    modules = [p for package in PRODUCT for p in (CHECKOUT / package).rglob("*.py")]
    assert len(modules) > 50  # the walk found the product
    offenders = [str(p.relative_to(CHECKOUT)) for p in modules if "tests" in imported_roots(p)]
    assert offenders == []


def test_the_harness_runs_from_the_checkout_that_holds_it() -> None:
    assert Path(__file__).resolve().parents[2] == CHECKOUT
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "flowforge"
    assert (CHECKOUT / "scripts" / "services").is_file()
    assert services.DEFAULT_BASE_DIR == CHECKOUT / ".services"  # git-ignored, per checkout
