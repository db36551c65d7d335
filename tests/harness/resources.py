"""Small shared pieces for tests, benchmarks and the chaos soak: scratch databases, free ports,
child processes, a ``flowforge up`` tree. One definition each, instead of one per harness."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.harness import CHECKOUT


def create_database(server_url: str, prefix: str) -> str:
    """Create an empty database named ``<prefix>_<random>`` on ``server_url``; return its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_url)
    params["dbname"] = name
    return make_conninfo("", **params)


def drop_database(server_url: str, database_url: str) -> None:
    """Drop the database ``database_url`` names, ending its sessions (a scratch database)."""
    name = str(conninfo_to_dict(database_url)["dbname"])
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def free_ports(count: int) -> list[int]:
    """``count`` distinct currently free ports on 127.0.0.1 (held together, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def child_pids(pid: int, recursive: bool = False) -> list[int]:
    """The children of ``pid`` (and theirs, with ``recursive``), read from /proc."""
    try:
        found = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    if recursive:
        found += [g for c in found for g in child_pids(c, recursive=True)]
    return found


def start_tree(config: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``flowforge -c CONFIG up`` from the checkout, its stderr appended to ``log``.

    The working directory is the checkout: under ``python -m`` the interpreter puts it first on
    ``sys.path``, and ``flowforge up`` hands that entry to the tree it execs (PATH0,
    flowforge/tree.py), so handler modules of the harness named in ``config``
    (``tests.harness.bench_handlers``) import from this checkout wherever the caller runs.
    """
    with log.open("ab") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=CHECKOUT,
            env=dict(env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
