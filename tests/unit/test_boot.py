"""The boot code knows every kind of child; the roles know no interface.

``flowforge/boot.py`` maps role names to entries (the api's among them); ``flowforge/roles/``
runs the role it is handed. Each role really running through these entries is proven by the
tests that start ``flowforge role NAME`` and ``flowforge up`` (tests/integration/test_api.py,
test_roles_delivery.py, ...); here, the import graph and the table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import flowforge.roles
from flowforge import boot, up
from flowforge.cli.main import build_parser
from flowforge.config import load_config

ROLES_DIR = Path(flowforge.roles.__file__).parent
#: What a role may never reach up into.
INTERFACES = ("flowforge.api", "flowforge.cli")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at any depth of the code (lazy imports too), as absolute
    names; ``from x import y`` counts as ``x.y`` too, since ``y`` may be a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _reaches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_import_check_sees_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from flowforge.api.server import ApiServer\n"
        "from .. import cli\nimport flowforge.store.db\n"
    )
    found = imported_modules(source, "flowforge.roles")
    assert {"flowforge.api.server", "flowforge.cli", "flowforge.store.db"} <= found
    assert {m for m in found if _reaches(m, INTERFACES)}


def test_no_role_module_imports_an_interface() -> None:
    files = sorted(ROLES_DIR.rglob("*.py"))
    assert len(files) > 5  # the folder was found
    offending = {
        f"{path.relative_to(ROLES_DIR)}: {module}"
        for path in files
        for module in imported_modules(path, "flowforge.roles")
        if _reaches(module, INTERFACES)
    }
    assert not offending, offending


def test_every_role_the_command_offers_has_an_entry(capsys: pytest.CaptureFixture[str]) -> None:
    for name in boot.ROLES:
        assert build_parser().parse_args(["role", name]).name == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["role", "no-such-role"])
    offered = re.search(r"choose from (.*?)\)", capsys.readouterr().err)
    assert offered, "argparse names the choices"
    assert {c.strip(" '") for c in offered[1].split(",")} == set(boot.ROLES)


def test_every_child_of_the_tree_has_an_entry(tmp_path: Path) -> None:
    config_file = tmp_path / "flowforge.yaml"
    config_file.write_text("api:\n  listen: 127.0.0.1:0\n")
    names = {spec.name for spec in up.build_specs(load_config(config_file, env={}))}
    assert names == set(boot.ROLES) == {"scheduler", "publisher", "worker", "api"}


def test_the_tree_readiness_reaches_the_api_entry_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_run(name: str, build: object, config: object, **hooks: object) -> int:
        seen.update(name=name, build=build, hooks=sorted(hooks))
        return 0

    def api_entry(config: object, telemetry: object, given: boot.Given) -> object:
        seen["given"] = given
        return "role"

    monkeypatch.setattr("flowforge.roles.main.run", fake_run)
    monkeypatch.setitem(boot.ROLES, "api", api_entry)
    given = boot.Given(tree=dict)
    assert boot.run("api", None, given=given) == 0  # type: ignore[arg-type]
    assert seen["name"] == "api" and seen["hooks"] == ["beat", "ready"]
    assert seen["build"](None, None) == "role"  # type: ignore[operator]
    assert seen["given"] is given
