"""The source distribution: built by setuptools' own PEP 517 backend from a copy of the checkout,
it carries the docs, the example config and workflows, the systemd unit, the README and the
LICENSE, and a wheel built from it alone holds the product with its data files.

The backend is the running environment's setuptools when it reads the SPDX ``license`` string
(77 or newer: the ``test`` extra asks for it); otherwise pip fetches it into a temporary folder,
as its build isolation would (about 3 s; measured in the report of issue 16).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import flowforge

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: The first setuptools that accepts ``license = "Apache-2.0"`` (PEP 639).
SETUPTOOLS_MIN = 77
#: Never part of a build: version control, caches, local services, earlier builds.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".services", ".*_cache", ".hypothesis", "__pycache__", "*.egg-info",
    "build", "dist", "artifacts", "test-artifacts",
)  # fmt: skip


def _environment_has_backend() -> bool:
    done = subprocess.run(
        [sys.executable, "-c", "import setuptools; print(setuptools.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip().split(".")[0]) >= SETUPTOOLS_MIN


@pytest.fixture(scope="module")
def backend_path(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """A folder holding a new enough setuptools, or None when this environment has one."""
    if _environment_has_backend():
        return None
    target = tmp_path_factory.mktemp("backend")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target)]
    subprocess.run([*pip, f"setuptools>={SETUPTOOLS_MIN}"], check=True, timeout=300)
    return str(target)


def build(hook: str, source: Path, out: Path, backend_path: str | None) -> Path:
    """Run setuptools' PEP 517 ``hook`` (build_sdist, build_wheel) in ``source``; the artifact."""
    # -S: only the backend (setuptools has no dependencies), not this environment's packages
    python = [sys.executable, "-S"] if backend_path else [sys.executable]
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    done = subprocess.run(
        [*python, "-c", code],
        cwd=source,
        env={"PYTHONPATH": backend_path or "", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory, backend_path: str | None) -> Path:
    source = tmp_path_factory.mktemp("source") / "flowforge"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)  # the checkout stays untouched
    return build("build_sdist", source, tmp_path_factory.mktemp("dist"), backend_path)


def test_the_sdist_carries_the_docs_the_example_config_and_the_license(sdist: Path) -> None:
    assert sdist.name == f"flowforge-{flowforge.__version__}.tar.gz"
    prefix = f"flowforge-{flowforge.__version__}/"
    with tarfile.open(sdist) as archive:
        names = {n.removeprefix(prefix) for n in archive.getnames()}
        pkg_info = archive.extractfile(prefix + "PKG-INFO")
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    expected = {
        "README.md",
        "LICENSE",
        "pyproject.toml",
        "docs/architecture.md",
        "docs/operations.md",
        "config/flowforge.example.yaml",
        "config/workflows/catalogue-import.yaml",
        "config/workflows/hello.yaml",
        "config/workflows/order-fulfilment.yaml",
        "config/examples/handlers.py",
        "deploy/systemd/flowforge.service",
        "deploy/systemd/flowforge.sysusers",
        "flowforge/py.typed",
        "flowforge/store/queries.sql",
    }
    assert expected <= names, sorted(expected - names)
    assert not {n for n in names if "__pycache__" in n or n.endswith(".pyc")}
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {flowforge.__version__}" in metadata


def test_a_wheel_built_from_the_sdist_alone_holds_the_product(
    sdist: Path, tmp_path: Path, backend_path: str | None
) -> None:
    unpacked = tmp_path / "unpacked"
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    wheel = build("build_wheel", source, tmp_path, backend_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    dist_info = f"flowforge-{flowforge.__version__}.dist-info"
    for needed in (
        "flowforge/py.typed",
        "flowforge/store/queries.sql",
        "supervisor/__init__.py",
        f"{dist_info}/licenses/LICENSE",
        f"{dist_info}/entry_points.txt",
    ):
        assert needed in names, needed
    assert not {n for n in names if n.startswith(("docs/", "config/", "deploy/", "tests/"))}
