"""Private PostgreSQL and RabbitMQ instances for tests and local development.

The instances themselves are the product's (:mod:`flowforge.devservices`, which ``flowforge
dev`` runs for a project): each lives entirely under a base directory of its own, listens on
127.0.0.1 only, on ports chosen by the caller, never reads the machine's shared configuration
and is addressed by the pid it recorded, never by name. This module re-exports them for the
tests and the rest of the harness, and adds the checkout's own instances: the defaults below,
under ``.services/``, and the command line ``scripts/services`` runs::

    python -m tests.harness.services start [--pg-port N] [--amqp-port N]
    python -m tests.harness.services stop | status | env | urls
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowforge.devservices.postgres import (
    PG_BIN_DIR,
    PG_DATABASE,
    PG_PACKAGE,
    PG_USER,
    PrivatePostgres,
)
from flowforge.devservices.procs import (
    CONNECT_TIMEOUT_S,
    LOOPBACK,
    ServiceError,
    ServiceUnavailable,
    ensure_base_dir,
    ephemeral_range,
)
from flowforge.devservices.rabbitmq import (
    RABBIT_PACKAGE,
    RABBIT_USER,
    PrivateEpmd,
    PrivateRabbitMQ,
)
from tests.harness import CHECKOUT

#: What the tests and the rest of the harness import from here.
__all__ = [
    "CONNECT_TIMEOUT_S",
    "DEFAULT_PORTS",
    "LOOPBACK",
    "PG_BIN_DIR",
    "PG_DATABASE",
    "PG_PACKAGE",
    "PG_USER",
    "RABBIT_PACKAGE",
    "RABBIT_USER",
    "PrivateEpmd",
    "PrivatePostgres",
    "PrivateRabbitMQ",
    "ServiceError",
    "ServiceUnavailable",
    "ephemeral_range",
    "main",
]

logger = logging.getLogger(__name__)

# --- command line defaults ------------------------------------------------------------------
DEFAULT_BASE_DIR = CHECKOUT / ".services"
BASE_DIR_ENV = "FLOWFORGE_SERVICES_DIR"
# Below the kernel's ephemeral range (32768-60999 on Linux): an outgoing connection of this
# machine is never given one, so a start never finds one taken by chance (55672 once was), and
# clear of RabbitMQ's own 25672 (a distribution port of the machine's broker). The private epmd
# takes DEFAULT_DIST_PORT + 1.
DEFAULT_PG_PORT = 26432
DEFAULT_AMQP_PORT = 26672
DEFAULT_DIST_PORT = 26673
#: Every port the dev services use by default (tests.harness.resources never hands them out).
DEFAULT_PORTS = frozenset(
    {DEFAULT_PG_PORT, DEFAULT_AMQP_PORT, DEFAULT_DIST_PORT, DEFAULT_DIST_PORT + 1}
)
DEFAULT_NODE_NAME = "flowforge-dev"
STATE_FILE_NAME = "services.json"
LOCK_FILE_NAME = "services.lock"
DATABASE_URL_ENV = "FLOWFORGE_TEST_DATABASE_URL"
BROKER_URL_ENV = "FLOWFORGE_TEST_BROKER_URL"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_RUNNING = 3


# =========================================================================================
# command line
# =========================================================================================


@dataclass(frozen=True)
class _CliConfig:
    """Where the dev services live and which ports they use."""

    base_dir: Path
    pg_port: int
    amqp_port: int
    dist_port: int
    node_name: str = DEFAULT_NODE_NAME

    def postgres(self) -> PrivatePostgres:
        return PrivatePostgres(self.base_dir, self.pg_port)

    def rabbitmq(self) -> PrivateRabbitMQ:
        return PrivateRabbitMQ(self.base_dir, self.amqp_port, self.dist_port, self.node_name)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="services", description="Private PostgreSQL + RabbitMQ for FlowForge tests."
    )
    parser.add_argument(
        "--base-dir",
        type=Path,
        default=None,
        help=f"state directory (default ${BASE_DIR_ENV} or {DEFAULT_BASE_DIR})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("start", "start both services (idempotent) and print their URLs"),
        ("stop", "stop both services"),
        ("status", "show state; exit 0 if both run, 3 otherwise"),
        ("env", "print export lines for the test URLs"),
        ("urls", "print the URLs"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--pg-port", type=int, default=None)
        sub.add_argument("--amqp-port", type=int, default=None)
        sub.add_argument("--dist-port", type=int, default=None)
    return parser


def _load_state(base_dir: Path) -> dict[str, int]:
    """Ports recorded by the last ``start`` ({} if none)."""
    try:
        data = json.loads((base_dir / STATE_FILE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def _resolve_config(args: argparse.Namespace) -> _CliConfig:
    """Ports from the command line, else from the last ``start``, else the defaults."""
    base_dir = args.base_dir or Path(os.environ.get(BASE_DIR_ENV, DEFAULT_BASE_DIR))
    state = _load_state(base_dir)
    amqp_port = args.amqp_port or state.get("amqp_port", DEFAULT_AMQP_PORT)
    default_dist = DEFAULT_DIST_PORT if amqp_port == DEFAULT_AMQP_PORT else amqp_port + 1
    return _CliConfig(
        base_dir=base_dir.absolute(),
        pg_port=args.pg_port or state.get("pg_port", DEFAULT_PG_PORT),
        amqp_port=amqp_port,
        dist_port=args.dist_port or state.get("dist_port", default_dist),
    )


@contextlib.contextmanager
def _locked(base_dir: Path) -> Iterator[None]:
    """Serialise CLI invocations sharing ``base_dir`` with an exclusive flock."""
    ensure_base_dir(base_dir)
    with (base_dir / LOCK_FILE_NAME).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _print_urls(cfg: _CliConfig) -> None:
    print(f"database: {cfg.postgres().url}")
    print(f"broker:   {cfg.rabbitmq().url}")


def _cmd_start(cfg: _CliConfig) -> int:
    _warn_if_ephemeral(cfg)
    with _locked(cfg.base_dir):
        cfg.postgres().start()
        cfg.rabbitmq().start()
        state = {"pg_port": cfg.pg_port, "amqp_port": cfg.amqp_port, "dist_port": cfg.dist_port}
        (cfg.base_dir / STATE_FILE_NAME).write_text(json.dumps(state) + "\n")
    _print_urls(cfg)
    return EXIT_OK


def _warn_if_ephemeral(cfg: _CliConfig) -> None:
    """One stderr line per port of ``cfg`` in the ephemeral range (e.g. recorded by a start
    before the defaults moved below it): an outgoing connection may hold it at any start."""
    first, last = ephemeral_range()
    for label, port in (("PostgreSQL", cfg.pg_port), ("AMQP", cfg.amqp_port)):
        if first <= port <= last:
            print(
                f"services: warning: {label} port {port} is in this machine's ephemeral range "
                f"({first}-{last}), where an outgoing connection may take it; to move to the "
                f"defaults: stop, remove {cfg.base_dir / STATE_FILE_NAME}, start",
                file=sys.stderr,
            )


def _cmd_stop(cfg: _CliConfig) -> int:
    with _locked(cfg.base_dir):
        cfg.rabbitmq().stop()
        cfg.postgres().stop()
    print("stopped")
    return EXIT_OK


def _cmd_status(cfg: _CliConfig) -> int:
    running = 0
    for label, service in (("postgres", cfg.postgres()), ("rabbitmq", cfg.rabbitmq())):
        pid = service.pid
        state = f"running (pid {pid})" if pid is not None else "stopped"
        running += pid is not None
        print(f"{label:<9} {state:<22} {service.url}")
    return EXIT_OK if running == 2 else EXIT_NOT_RUNNING


def _cmd_env(cfg: _CliConfig) -> int:
    print(f"export {DATABASE_URL_ENV}={shlex.quote(cfg.postgres().url)}")
    print(f"export {BROKER_URL_ENV}={shlex.quote(cfg.rabbitmq().url)}")
    return EXIT_OK


def _cmd_urls(cfg: _CliConfig) -> int:
    _print_urls(cfg)
    return EXIT_OK


_COMMANDS: dict[str, Callable[[_CliConfig], int]] = {
    "start": _cmd_start,
    "stop": _cmd_stop,
    "status": _cmd_status,
    "env": _cmd_env,
    "urls": _cmd_urls,
}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (errors: one stderr line, status 1)."""
    args = _build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return _COMMANDS[args.command](_resolve_config(args))
    except (ServiceError, OSError) as exc:
        print(f"services: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
