"""``python -P -m flowforge.tree LABEL PATH0 [CONFIG]``: the process ``flowforge up`` becomes.

``flowforge up`` validates the config, then replaces itself (same pid) with a fresh interpreter
running this module, so the supervisor — and, through fork, every child — holds none of the
command line's modules (argparse, the commands): about 0.5 MiB per process, 3.3 MiB for a tree
of four workers (docs/performance.md, "Memory"). Not meant to be run by hand.

What ``flowforge up`` read crosses the exec in an anonymous memory file (``memfd_create``)
whose descriptor :data:`SECRETS_FD_ENV` names; the tree reads and closes it before it forks
anything. It holds:

- the config file's document as parsed (``config``), which the tree validates again without
  parsing YAML: neither the supervisor nor, through fork, a child that reads no YAML file holds
  PyYAML (docs/performance.md, "PyYAML out of the supervisor"). A document JSON cannot carry
  exactly (a YAML date, a key that is not text, a NaN), one nested deeper than JSON's encoder
  goes, or one over :data:`MAX_SECRETS_BYTES`, is left out, and the tree reads the file again.
- the secrets given as variables (``FLOWFORGE_DATABASE_URL``, ``FLOWFORGE_BROKER_URL``, the api
  token's), which do not cross in the environment: a process's initial environment stays in its
  memory, where ``/proc/PID/environ`` of every forked child shows it, and ``os.environ`` would
  hand it to every handler and every program a handler starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import NoReturn

from flowforge.cli import exitcodes
from flowforge.config import Config, ConfigSource, config_from, load_config, secret_variables
from flowforge.errors import ConfigError

#: ``-P``: the new interpreter adds no directory of its own to ``sys.path``; it puts back the
#: first entry of the old one (PATH0: the console script's folder, or the working directory
#: under ``python -m``), so handler modules import exactly as they would have without the exec.
INTERPRETER_OPTIONS = ("-P",)
#: The variable naming the descriptor that carries the config and the secrets across the exec
#: (module doc).
SECRETS_FD_ENV = "FLOWFORGE_SECRETS_FD"
#: The most the memory file may hold (bytes): a config document and three secrets.
MAX_SECRETS_BYTES = 16 * 1024 * 1024


def become_tree(
    config: Config, source: ConfigSource | None, config_path: str | None, label: str
) -> NoReturn:
    """Replace this process with ``python -m flowforge.tree``, handing it ``source`` (the
    document ``config`` was validated from) and the secret variables in a memory file, the
    secrets moved out of the environment (module doc).

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
    fd = os.memfd_create("flowforge-secrets", 0)  # inherited: no MFD_CLOEXEC
    try:
        os.write(fd, _handover(secrets, source))  # a memory file takes it in one write
        os.lseek(fd, 0, os.SEEK_SET)
        env[SECRETS_FD_ENV] = str(fd)
        os.execve(sys.executable, argv, env)
    finally:
        os.close(fd)  # only reached when the exec failed


def _handover(secrets: Mapping[str, str], source: ConfigSource | None) -> bytes:
    """The memory file's content: ``secrets``, and ``source`` when JSON carries it exactly."""
    given: dict[str, object] = {"secrets": dict(secrets)}
    if source is not None:
        document = {"data": source.data, "base_dir": source.base_dir, "where": source.where}
        try:
            exact = json.loads(json.dumps(document)) == document
        except (TypeError, ValueError, RecursionError):  # a date, a set; nested too deep
            exact = False
        if exact:
            given["config"] = document
    encoded = json.dumps(given).encode()
    if len(encoded) > MAX_SECRETS_BYTES:  # the tree would read a part: it reads the file
        encoded = json.dumps({"secrets": given["secrets"]}).encode()
    return encoded


def _take_handover(env: MutableMapping[str, str]) -> tuple[Mapping[str, str], ConfigSource | None]:
    """The secret variables and the config document ``flowforge up`` handed over (module doc),
    read from the descriptor ``env`` names, which is closed; ``({}, None)`` when there is none.
    Raises ``ValueError`` when the variable does not name a readable descriptor holding them."""
    named = env.pop(SECRETS_FD_ENV, None)
    if named is None:
        return {}, None
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
        given = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        given = None
    refused = ValueError(f"{SECRETS_FD_ENV}: descriptor {fd} does not hold the tree's config")
    if not isinstance(given, dict):
        raise refused
    secrets, document = given.get("secrets"), given.get("config")
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        raise refused
    if document is None:
        return secrets, None
    if not isinstance(document, dict) or not isinstance(document.get("data"), dict):
        raise refused
    base_dir, where = document.get("base_dir"), document.get("where")
    if not isinstance(base_dir, str) or not isinstance(where, str):
        raise refused
    return secrets, ConfigSource(document["data"], base_dir, where)


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
        secrets, source = _take_handover(os.environ)
        env = {**os.environ, **secrets}
        # the document as `flowforge up` read it, or (not handed over) the file read again
        if source is not None:
            config = config_from(source, env)
        else:
            config = load_config(config_path, env=env)
    except (ConfigError, ValueError) as exc:  # a file changed since `flowforge up` read it
        sys.stderr.write(f"flowforge: {' '.join(str(exc).split())}\n")
        return exitcodes.USAGE
    return up.run(config, label)


if __name__ == "__main__":
    sys.exit(main())
