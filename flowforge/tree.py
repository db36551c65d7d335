"""``python -P -m flowforge.tree LABEL PATH0 [CONFIG]``: the process ``flowforge up`` becomes.

``flowforge up`` validates the config, then replaces itself (same pid) with a fresh interpreter
running this module, so the supervisor — and, through fork, every child — holds none of the
command line's modules (argparse, the commands): about 0.5 MiB per process, 3.3 MiB for a tree
of four workers (docs/performance.md, "Memory"). Not meant to be run by hand.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from flowforge.cli import exitcodes
from flowforge.config import load_config
from flowforge.errors import ConfigError

#: ``-P``: the new interpreter adds no directory of its own to ``sys.path``; it puts back the
#: first entry of the old one (PATH0: the console script's folder, or the working directory
#: under ``python -m``), so handler modules import exactly as they would have without the exec.
INTERPRETER_OPTIONS = ("-P",)


def become_tree(config_path: str | None, label: str) -> NoReturn:
    """Replace this process with ``python -m flowforge.tree`` (the config is read again there).

    Only returns by raising ``OSError`` when the interpreter cannot be executed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *INTERPRETER_OPTIONS, "-m", __name__, label, sys.path[0]]
    if config_path:
        argv.append(config_path)
    os.execv(sys.executable, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tree; the exit codes are ``flowforge up``'s (README, "Exit codes")."""
    from flowforge import up

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        sys.stderr.write("flowforge: usage: python -P -m flowforge.tree LABEL PATH0 [CONFIG]\n")
        return exitcodes.USAGE
    label, path0, config_path = args[0], args[1], (args[2] if len(args) > 2 else None)
    if path0 not in sys.path:
        sys.path.insert(0, path0)
    try:
        config = load_config(config_path)
    except ConfigError as exc:  # the file changed since `flowforge up` validated it
        sys.stderr.write(f"flowforge: {' '.join(str(exc).split())}\n")
        return exitcodes.USAGE
    return up.run(config, label)


if __name__ == "__main__":
    sys.exit(main())
