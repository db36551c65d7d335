"""The api children of a ``flowforge up`` tree, and the api alone under the tree's supervisor.

:func:`api_pids` finds a tree's api children by their process title (``flowforge: api``, or
``flowforge: api 2/3`` with ``api.processes`` above 1; setproctitle is a dependency of
FlowForge). :func:`serve` runs only the api spec of ``flowforge up`` (``api.processes`` children
on one socket bound before the first fork, as the tree's), for ``bench_submit --api-only``: the
submission path's own figures without a tree executing the runs::

    python -m tests.harness.api_children CONFIG
"""

from __future__ import annotations

import sys
from pathlib import Path

from flowforge import up
from flowforge.api.listener import bind_listener
from flowforge.config import load_config
from supervisor import logs
from supervisor.tree import Supervisor
from tests.harness.resources import child_pids

API_TITLE = f"{up.TITLE_PREFIX}: api"


def title(pid: int) -> str:
    """The process title of ``pid`` (its command line as ``ps`` shows it), '' if gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def api_pids(supervisor: int) -> list[int]:
    """The pids of the api children of the tree whose supervisor is ``supervisor``."""
    return [
        pid
        for pid in child_pids(supervisor)
        if title(pid) == API_TITLE or title(pid).startswith(API_TITLE + " ")
    ]


def serve(config_path: Path) -> int:
    """The api children of ``flowforge up`` with the config at ``config_path``, and nothing
    else, until SIGTERM; the supervisor's exit code."""
    config = load_config(config_path)
    if config.api is None:
        sys.stderr.write(f"{config_path}: no api section\n")
        return 2
    level = config.logging.level
    logs.configure("supervisor", config.logging.format, level)
    with bind_listener(config.api.listen) as listener:
        specs = [s for s in up.build_specs(config, listener) if s.name == "api"]
        tree = Supervisor(
            specs,
            title_prefix=up.TITLE_PREFIX,
            child_setup=lambda label: logs.configure(label, config.logging.format, level),
        )
        return tree.run()


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))
