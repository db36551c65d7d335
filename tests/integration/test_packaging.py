"""The wheel holds the product and nothing else: a wheel is built from this checkout and listed.

pip builds in the source tree (it leaves ``build/`` and ``*.egg-info`` there, and setuptools
never prunes ``build/lib``, so modules moved away long ago would still ship), hence the wheel
is built from a copy of exactly the files git sees: what a fresh clone builds. The build is
isolated, as ``pip install`` does it: the test venv's own setuptools is not one this
pyproject names (scripts/bootstrap's venv carries the interpreter's bundled setuptools and
no ``wheel``), so pip fetches the build requirements ``[build-system]`` lists.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import CHECKOUT

BUILD_TIMEOUT_S = 300
# The first test also pays for the build (about 10 s here; pip may download setuptools).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + 60)]

PRODUCT = ("flowforge", "supervisor")


def source_files() -> list[str]:
    """The checkout's files git sees (tracked or new, not ignored, not deleted), relative."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=CHECKOUT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return sorted(name for name in set(listed.split("\0")) if name and (CHECKOUT / name).is_file())


def product_files(names: list[str]) -> set[str]:
    """The names under the product packages, without bytecode."""
    return {
        name
        for name in names
        if name.split("/", 1)[0] in PRODUCT and "__pycache__" not in name.split("/")
    }


@pytest.fixture(scope="module")
def sources() -> list[str]:
    return source_files()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, sources: list[str]) -> Iterator[Path]:
    source = tmp_path_factory.mktemp("source")
    for name in sources:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(CHECKOUT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = list(out.glob("flowforge-*.whl"))
    assert len(wheels) == 1, wheels
    yield wheels[0]


@pytest.fixture(scope="module")
def listing(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def test_the_wheel_holds_every_file_of_the_product_and_nothing_else_of_the_checkout(
    sources: list[str], listing: set[str]
) -> None:
    expected = product_files(sources)
    # Not vacuous: the modules, the SQL, the dashboard's assets are all in the expectation.
    assert {
        "flowforge/__init__.py",
        "flowforge/testing/__init__.py",
        "supervisor/tree.py",
        "flowforge/store/queries.sql",
        "flowforge/store/migrations/0001_initial.sql",
        "flowforge/dashboard/static/app.js",
        "flowforge/dashboard/templates/layout.html",
    } <= expected
    packaged = {name for name in listing if ".dist-info/" not in name}
    assert packaged - expected == set(), "shipped but not part of the product"
    assert expected - packaged == set(), "part of the product but not shipped"
    others = {name.split("/", 1)[0] for name in listing} - set(PRODUCT)
    assert len(others) == 1 and others.pop().endswith(".dist-info")


def test_the_wheel_holds_no_tests_and_no_harness(wheel: Path, listing: set[str]) -> None:
    modules = [p for p in (CHECKOUT / "tests" / "harness").glob("*.py") if p.name != "__init__.py"]
    harness = {p.name for p in modules}
    assert {"services.py", "bench_handlers.py", "chaos_handlers.py"} <= harness  # not vacuous
    assert not [name for name in listing if name.startswith("tests/") or "/harness/" in name]
    # nor a harness module under another name or package: no shipped file has a harness
    # module's content (names alone would mistake flowforge/broker/tls.py for tests/harness/tls.py)
    contents = {p.read_bytes() for p in modules}
    with zipfile.ZipFile(wheel) as archive:
        copied = [name for name in listing if archive.read(name) in contents]
    assert not copied
    assert not [name for name in listing if name.endswith("_handlers.py")]


def test_every_module_of_the_wheel_imports_without_the_checkout(
    wheel: Path, tmp_path: Path
) -> None:
    """Unpacked alone and imported with ``-I`` (no working directory, no PYTHONPATH on the
    path), from a directory outside the checkout: no product module needs ``tests`` or a
    file of the checkout to import."""
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    probe = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        root = sys.argv[1]
        sys.path.insert(0, root)
        names = []
        for package in ("flowforge", "supervisor"):
            module = importlib.import_module(package)
            names.append(package)
            for info in pkgutil.walk_packages(module.__path__, package + "."):
                if info.name.rsplit(".", 1)[-1] == "__main__":
                    continue  # runs the command line when imported
                importlib.import_module(info.name)
                names.append(info.name)
        outside = [n for n in names if not sys.modules[n].__file__.startswith(root + "/")]
        assert not outside, outside
        assert not [n for n in sys.modules if n == "tests" or n.startswith("tests.")]
        print(len(names))
        """
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(unpacked)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) >= 50  # every module was walked, not just the packages
