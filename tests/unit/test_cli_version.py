"""``flowforge --version``: the installed distribution's version, or the package's own in a
checkout that is not installed; pyproject.toml reads the same ``__version__``."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import flowforge
from flowforge.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["--version"], ["-c", "no-such.yaml", "--version"]])
def test_flowforge_version_prints_the_version_and_exits_0(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert re.fullmatch(r"flowforge \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout
    assert done.stdout == f"flowforge {cli_main.version()}\n"


def test_a_checkout_that_is_not_installed_falls_back_to_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli_main.version() == flowforge.__version__


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "flowforge.__version__"}
