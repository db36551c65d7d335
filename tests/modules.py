"""Throw-away Python modules for tests of what imports the config's modules (handlers,
workflow_modules): a folder for them, and sys.path and sys.modules restored after."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder for throw-away handler modules; sys.path and sys.modules restored after."""
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    yield tmp_path
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        origin = getattr(sys.modules[name], "__file__", None) or ""
        if origin.startswith(str(tmp_path)):
            del sys.modules[name]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def write_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
