"""psycopg's version modules served without ``importlib.metadata`` (flowforge/distversions.py):
the same versions, and the supervisor's preload no longer imports it (docs/performance.md,
"Memory")."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flowforge.distversions import VERSION_MODULES, VersionFinder, installed_version


def dist_info(folder: Path, name: str, version: str | None, suffix: str = "dist-info") -> None:
    info = folder / f"{name}-{version or '0'}.{suffix}"
    info.mkdir(parents=True)
    headers = ["Metadata-Version: 2.1", f"Name: {name}"]
    if version is not None:
        headers.append(f"Version: {version}")
    body = "\n".join([*headers, "", "Version: 9.9 (the description, not a header)"])
    (info / ("PKG-INFO" if suffix == "egg-info" else "METADATA")).write_text(body)


@pytest.mark.parametrize("distribution", sorted(VERSION_MODULES.values()))
def test_each_version_is_the_one_importlib_metadata_gives(distribution: str) -> None:
    assert installed_version(distribution) == importlib.metadata.version(distribution)


def test_the_first_dist_info_on_the_path_wins_under_any_spelling_of_the_name(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    dist_info(first, "Foo_Bar", "1.2.3")
    dist_info(second, "foo_bar", "4.5")
    dist_info(second, "foo_bar_baz", "7.0")
    path = [str(tmp_path / "missing"), str(first), str(second)]
    assert installed_version("foo-bar", path) == "1.2.3"
    assert installed_version("Foo.Bar", path[2:]) == "4.5"
    assert installed_version("foo-bar-baz", path) == "7.0"
    assert installed_version("foo", path) is None


def test_it_declines_what_a_plain_read_cannot_answer_as_importlib_metadata_would(
    tmp_path: Path,
) -> None:
    egg, headless, archive, plain = (tmp_path / n for n in ("egg", "headless", "x.zip", "plain"))
    dist_info(egg, "foo", "1.0", suffix="egg-info")
    dist_info(headless, "foo", None)
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("foo-2.0.dist-info/METADATA", "Name: foo\nVersion: 2.0\n")
    dist_info(plain, "foo", "3.0")
    assert installed_version("foo", [str(plain)]) == "3.0"
    for first in (egg, headless, archive):
        assert installed_version("foo", [str(first), str(plain)]) is None, first


def test_the_finder_serves_only_its_modules() -> None:
    finder = VersionFinder()
    assert finder.find_spec("psycopg.pq", None) is None
    assert finder.find_spec("json", None) is None
    spec = finder.find_spec("psycopg_pool.version", None)
    assert spec is not None and spec.loader_state == importlib.metadata.version("psycopg-pool")


def test_the_supervisors_preload_imports_no_importlib_metadata_and_keeps_the_versions() -> None:
    code = (
        "import sys, json\n"
        "from flowforge import up\n"
        "up.preload_driver()\n"
        "import psycopg, psycopg_binary, psycopg_pool\n"
        "loaded = 'importlib.metadata' in sys.modules\n"
        "print(json.dumps([loaded, psycopg.__version__, psycopg_binary.__version__,\n"
        "                  psycopg_pool.__version__, psycopg.version.__version__]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded, *versions = json.loads(done.stdout)
    assert not loaded
    assert versions == [
        importlib.metadata.version("psycopg"),
        importlib.metadata.version("psycopg-binary"),
        importlib.metadata.version("psycopg-pool"),
        importlib.metadata.version("psycopg"),
    ]
