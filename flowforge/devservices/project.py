"""One project's private PostgreSQL and RabbitMQ, as ``flowforge dev`` runs them.

They live in the project's state directory (``.flowforge-dev/`` beside the config by default):
the database's data and the broker's node survive from one ``flowforge dev`` to the next, and so
do their ports, chosen once and recorded in ``services.json``. Ports come from below the kernel's
ephemeral range, so no outgoing connection of the machine is ever given one between two runs,
starting at a place derived from the state directory's path, so two projects on one machine
usually start at different ports and never take each other's recorded ones while both are up.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

from flowforge.devservices.postgres import PG_BIN_DIR, PrivatePostgres
from flowforge.devservices.procs import ServiceError, ensure_base_dir, ephemeral_range, port_in_use
from flowforge.devservices.rabbitmq import RABBIT_BIN_DIR, PrivateRabbitMQ

logger = logging.getLogger(__name__)

STATE_FILE = "services.json"
NODE_NAME = "flowforge-dev"
#: Where ports are drawn from: from here up to the ephemeral range.
PORT_FLOOR = 20000
#: Never chosen: the machine's own servers and the checkout's test services (scripts/services:
#: PostgreSQL 26432, AMQP 26672, distribution 26673, epmd 26674).
AVOIDED = frozenset({4369, 5432, 5672, 25672, 26432, 26672, 26673, 26674})
#: Ports one project uses: PostgreSQL, AMQP, Erlang distribution, epmd (in this order).
SPAN = 4


@dataclass(frozen=True)
class Ports:
    """The project's ports on 127.0.0.1; the private epmd listens on ``dist + 1``."""

    pg: int
    amqp: int
    dist: int

    def all(self) -> tuple[int, ...]:
        return (self.pg, self.amqp, self.dist, self.dist + 1)


def choose_ports(state_dir: Path) -> Ports:
    """The first block of :data:`SPAN` free consecutive ports at or after the state directory's
    own starting place (module doc). Raises ServiceError when none is free."""
    first, _ = ephemeral_range()
    blocks = list(range(PORT_FLOOR, first - SPAN, SPAN))
    if not blocks:
        raise ServiceError(f"no ports between {PORT_FLOOR} and the ephemeral range ({first})")
    start = zlib.crc32(str(state_dir).encode()) % len(blocks)
    for base in blocks[start:] + blocks[:start]:
        ports = range(base, base + SPAN)
        if not any(p in AVOIDED or port_in_use(p) for p in ports):
            return Ports(base, base + 1, base + 2)
    raise ServiceError(f"no {SPAN} free consecutive ports from {PORT_FLOOR} to {first}")


def recorded_ports(state_dir: Path) -> Ports | None:
    """The ports a previous run recorded (None: none, or a file this code did not write)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
        return Ports(int(data["pg_port"]), int(data["amqp_port"]), int(data["dist_port"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


class ProjectServices:
    """The project's PostgreSQL and RabbitMQ under ``state_dir`` on ``ports``."""

    #: Where the servers' binaries are (Debian's packages); a class attribute, so a test can
    #: point it at a folder without them.
    pg_bin_dir: Path = PG_BIN_DIR
    rabbit_bin_dir: Path = RABBIT_BIN_DIR

    def __init__(self, state_dir: Path, ports: Ports) -> None:
        self.state_dir = state_dir.absolute()
        self.ports = ports
        self.postgres = PrivatePostgres(self.state_dir, ports.pg, bin_dir=self.pg_bin_dir)
        self.rabbitmq = PrivateRabbitMQ(
            self.state_dir, ports.amqp, ports.dist, NODE_NAME, bin_dir=self.rabbit_bin_dir
        )

    @classmethod
    def for_project(
        cls,
        state_dir: Path,
        pg_port: int | None = None,
        amqp_port: int | None = None,
        dist_port: int | None = None,
    ) -> ProjectServices:
        """The services of ``state_dir`` on the ports given, else those recorded, else free
        ones (:func:`choose_ports`)."""
        state_dir = state_dir.absolute()
        known = recorded_ports(state_dir) or choose_ports(state_dir)
        return cls(
            state_dir,
            Ports(pg_port or known.pg, amqp_port or known.amqp, dist_port or known.dist),
        )

    @property
    def database_url(self) -> str:
        return self.postgres.url

    @property
    def broker_url(self) -> str:
        return self.rabbitmq.url

    def start(self) -> None:
        """Start both (each reused if it already runs), record the ports. Bounded: at most
        about two minutes for a first boot; ServiceError / DevServiceMissingError otherwise."""
        self.check_installed()
        ensure_base_dir(self.state_dir)
        self.state_dir.chmod(0o755)  # the service accounts enter it when run as root
        record = {
            "pg_port": self.ports.pg,
            "amqp_port": self.ports.amqp,
            "dist_port": self.ports.dist,
        }
        (self.state_dir / STATE_FILE).write_text(json.dumps(record) + "\n")
        self.postgres.start()
        self.rabbitmq.start()

    def check_installed(self) -> None:
        """Raise DevServiceMissingError naming the Debian package of the first binary or account
        either server lacks: checked before anything starts, so a machine without RabbitMQ gets
        the one line that says so, and no PostgreSQL to stop."""
        self.postgres.check_installed()
        self.rabbitmq.check_installed()

    def stop(self) -> list[str]:
        """Stop both, the broker first; each is tried whatever the other did. Returns what
        failed, one line each (empty: both stopped)."""
        failures = []
        for service in (self.rabbitmq, self.postgres):
            try:
                service.stop()
            except (ServiceError, OSError) as exc:
                failures.append(f"{service!r}: {exc}")
        return failures

    def pids(self) -> list[int]:
        """The live server processes (PostgreSQL's postmaster, RabbitMQ's beam)."""
        return [p for p in (self.postgres.pid, self.rabbitmq.pid) if p is not None]
