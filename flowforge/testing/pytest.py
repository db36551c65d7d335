"""An opt-in pytest plugin: a real FlowForge tree for your integration tests.

Turn it on in your root ``conftest.py`` (it is not loaded by merely installing FlowForge)::

    pytest_plugins = ["flowforge.testing.pytest"]

and name the config the tree runs (``--flowforge-config PATH``, the ini option
``flowforge_config``, or ``$FLOWFORGE_CONFIG``). The session fixture ``flowforge_tree`` creates
a scratch database on the config's PostgreSQL server (ini ``flowforge_scratch_database =
false`` uses the configured database as it is), migrates it, runs ``flowforge up`` on it until
every role is ready, and at the end of the session stops the tree (SIGTERM to its supervisor,
a bounded wait, SIGKILL past it) and drops the scratch database. ``flowforge_client`` is an
open :class:`~flowforge.Client` on it. docs/testing-workflows.md has the whole story.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowforge.client import Client
from flowforge.config import ENV_CONFIG, load_config
from flowforge.testing.tree import READY_TIMEOUT_S, TestTree, drop_database, scratch_database

__all__ = ["flowforge_client", "flowforge_tree"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flowforge", "FlowForge trees for integration tests")
    group.addoption(
        "--flowforge-config",
        default=None,
        help="the FlowForge config flowforge_tree runs (default: ini flowforge_config, "
        f"else ${ENV_CONFIG})",
    )
    parser.addini("flowforge_config", "the FlowForge config flowforge_tree runs", default="")
    parser.addini(
        "flowforge_scratch_database",
        "run the tree on a new database made for the session, dropped after it",
        type="bool",
        default=True,
    )
    parser.addini(
        "flowforge_ready_timeout",
        "seconds to wait for the tree to be ready",
        default=str(READY_TIMEOUT_S),
    )


def _config_path(config: pytest.Config) -> Path:
    given = (
        config.getoption("--flowforge-config")
        or config.getini("flowforge_config")
        or os.environ.get(ENV_CONFIG)
    )
    if not given:
        pytest.fail(
            "flowforge_tree needs a config: --flowforge-config PATH, the ini option "
            f"flowforge_config, or ${ENV_CONFIG}",
            pytrace=False,
        )
    path = Path(str(given))
    # an ini value is relative to the ini file's folder, as pytest's own paths are
    if not path.is_absolute() and not config.getoption("--flowforge-config") and config.inipath:
        path = config.inipath.parent / path
    return path


@pytest.fixture(scope="session")
def flowforge_tree(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestTree]:
    """A running ``flowforge up`` tree for the session (see the module docstring)."""
    path = _config_path(pytestconfig)
    scratch = None
    if pytestconfig.getini("flowforge_scratch_database"):
        scratch = scratch_database(load_config(path).database.url)
    log = tmp_path_factory.mktemp("flowforge") / "tree.log"
    tree = TestTree(path, log, database_url=scratch)
    try:
        tree.start(float(pytestconfig.getini("flowforge_ready_timeout")))
        yield tree
        died = tree.proc is not None and tree.proc.poll() is not None
        code = tree.stop()
        if died:
            pytest.fail(f"the FlowForge tree exited during the session ({code}); see {log}")
    finally:
        tree.stop()
        if scratch is not None:
            drop_database(scratch)


@pytest.fixture
def flowforge_client(flowforge_tree: TestTree) -> Iterator[Client]:
    """An open :class:`~flowforge.Client` on the session's tree (closed after the test)."""
    with flowforge_tree.client() as client:
        yield client
