"""``python -P -m flowforge.tree LABEL PATH0 [CONFIG]``: the process ``flowforge up`` becomes.

``flowforge up`` validates the config, then replaces itself (same pid) with a fresh interpreter
running this module, so the supervisor — and, through fork, every child — holds none of the
command line's modules (argparse, the commands): about 0.5 MiB per process, 3.3 MiB for a tree
of four workers (docs/performance.md, "Memory"). Not meant to be run by hand.

Secrets given as variables (``FLOWFORGE_DATABASE_URL``, ``FLOWFORGE_BROKER_URL``, the api
token's) do not cross the exec in the environment: a process's initial environment stays in its
memory, where ``/proc/PID/environ`` of every forked child shows it, and ``os.environ`` would hand
it to every handler and every program a handler starts. They cross in an anonymous memory file
(``memfd_create``) whose descriptor :data:`SECRETS_FD_ENV` names; the tree reads and closes it
before it forks anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import NoReturn

from flowforge.cli import exitcodes
from flowforge.config import Config, load_config, secret_variables
from flowforge.errors import ConfigError

#: ``-P``: the new interpreter adds no directory of its own to ``sys.path``; it puts back the
#: first entry of the old one (PATH0: the console script's folder, or the working directory
#: under ``python -m``), so handler modules import exactly as they would have without the exec.
INTERPRETER_OPTIONS = ("-P",)
#: The variable naming the descriptor that carries the secrets across the exec (module doc).
SECRETS_FD_ENV = "FLOWFORGE_SECRETS_FD"
#: The most a secrets file may hold (bytes): three values, each a URL list or a token.
MAX_SECRETS_BYTES = 1024 * 1024


def become_tree(config: Config, config_path: str | None, label: str) -> NoReturn:
    """Replace this process with ``python -m flowforge.tree`` (the config is read again there),
    its secret variables moved out of the environment into a memory file (module doc).

    Only returns by raising ``OSError`` when the interpreter cannot be executed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *INTERPRETER_OPTIONS, "-m", __name__, label, sys.path[0]]
    if config_path:
        argv.append(config_path)
    names = set(secret_variables(config))
    secrets = {name: value for name, value in os.environ.items() if name in names}
    env = {name: value for name, value in os.environ.items() if name not in names}
    if secrets:
        fd = os.memfd_create("flowforge-secrets", 0)  # inherited: no MFD_CLOEXEC
        try:
            os.write(fd, json.dumps(secrets).encode())  # a memory file takes it in one write
            os.lseek(fd, 0, os.SEEK_SET)
            env[SECRETS_FD_ENV] = str(fd)
            os.execve(sys.executable, argv, env)
        finally:
            os.close(fd)  # only reached when the exec failed
    os.execve(sys.executable, argv, env)


def _take_secrets(env: MutableMapping[str, str]) -> Mapping[str, str]:
    """The secret variables ``flowforge up`` handed over (module doc), read from the descriptor
    ``env`` names, which is closed; ``{}`` when there is none. Raises ``ValueError`` when the
    variable does not name a readable descriptor holding them."""
    named = env.pop(SECRETS_FD_ENV, None)
    if named is None:
        return {}
    if not named.isdigit():
        raise ValueError(f"{SECRETS_FD_ENV} is not a file descriptor")
    fd = int(named)
    try:
        data = os.read(fd, MAX_SECRETS_BYTES)
    except OSError as exc:
        raise ValueError(f"{SECRETS_FD_ENV}: cannot read descriptor {fd}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(OSError):  # not open: the read said so
            os.close(fd)
    try:
        secrets = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        secrets = None
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        raise ValueError(f"{SECRETS_FD_ENV}: descriptor {fd} does not hold the secrets")
    return secrets


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
        # os.environ too loses the variable: no child inherits it
        secrets = _take_secrets(os.environ)
        config = load_config(config_path, env={**os.environ, **secrets})
    except (ConfigError, ValueError) as exc:  # the file changed since `flowforge up` read it
        sys.stderr.write(f"flowforge: {' '.join(str(exc).split())}\n")
        return exitcodes.USAGE
    return up.run(config, label)


if __name__ == "__main__":
    sys.exit(main())
