"""The version modules of psycopg's packages, served without ``importlib.metadata``.

``psycopg``, ``psycopg_binary`` and ``psycopg_pool`` each import a ``version`` module that asks
``importlib.metadata`` for the package's version. That import pulls ``email``, ``zipfile``,
``csv`` and ``importlib.metadata`` itself into the process, about 1.1 MiB of objects that
nothing else in a tree uses; the supervisor imports psycopg before its first fork
(``up.preload_driver``), so every child inherits them and the tree's resident memory counts
them seven times: 7.4 MiB of a tree of four workers (docs/performance.md, "Memory").

:func:`install` puts a finder first on ``sys.meta_path`` that serves those three modules with
the same ``__version__``, read from the first ``*.dist-info/METADATA`` of the distribution on
``sys.path`` — where ``importlib.metadata`` looks first. Where that cannot be read plainly (no
such folder, an ``.egg-info`` or a zip archive first on the path), the finder declines and the
package's own module runs as usual.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # importlib.abc itself imports importlib.resources: not in every process
    from importlib.abc import Loader

#: The modules served, and the distribution whose version each one gives.
VERSION_MODULES = {
    "psycopg.version": "psycopg",
    "psycopg_binary.version": "psycopg-binary",
    "psycopg_pool.version": "psycopg-pool",
}


def normalize(name: str) -> str:
    """A distribution name as its folders spell it (PEP 503, with ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def installed_version(distribution: str, path: Sequence[str] | None = None) -> str | None:
    """The ``Version`` of the first ``*.dist-info`` of ``distribution`` on ``path`` (default
    ``sys.path``), or None when a plain read cannot say what ``importlib.metadata`` would."""
    wanted = normalize(distribution)
    for entry in sys.path if path is None else path:
        directory = entry or "."
        if os.path.isfile(directory):
            return None  # a zip archive: importlib.metadata reads those, this does not
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.rpartition(".")
            if (
                dot
                and suffix in ("dist-info", "egg-info")
                and normalize(stem.partition("-")[0]) == wanted
            ):
                if suffix == "egg-info":
                    return None
                return _metadata_version(os.path.join(directory, name, "METADATA"))
    return None


def _metadata_version(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as metadata:
            for line in metadata:
                if not line.strip():
                    break  # the headers end at the first blank line
                key, colon, value = line.partition(":")
                if colon and key.strip().lower() == "version":
                    return value.strip()
    except (OSError, UnicodeDecodeError):
        pass
    return None


class VersionFinder:
    """Serves :data:`VERSION_MODULES` (module doc); declines any other module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        distribution = VERSION_MODULES.get(fullname)
        if distribution is None:
            return None
        version = installed_version(distribution)
        if version is None:
            return None
        return ModuleSpec(fullname, cast("Loader", self), loader_state=version)

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None
        module.__version__ = module.__spec__.loader_state  # type: ignore[attr-defined]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); a version module already imported
    stays as it is."""
    if not any(isinstance(finder, VersionFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, VersionFinder())
