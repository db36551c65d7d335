"""TLS to PostgreSQL (``sslmode=verify-full``, a client certificate) and RabbitMQ (``amqps://``,
a client certificate, several nodes), against private servers and a throwaway CA.

The servers (tests/harness/tls.py) take TCP clients only over TLS with a client certificate
signed by the CA; the certificates of both are for ``127.0.0.1`` only. Every config here names
its certificate files relative to its own folder, and every command runs from another working
directory, so the relative paths are proven to be the config folder's.

A wrong CA, a missing client certificate, a host name the certificate does not name, a missing
root certificate: each is refused with one clear line and the configuration exit code (2 for
``flowforge migrate`` and the CLI, 3 for ``flowforge up``, whose role fails to boot), never as
an outage (7) or a reconnect loop.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from flowforge.broker import consume, publish
from flowforge.broker.consume import Consumer
from flowforge.broker.publish import ConfirmingPublisher
from flowforge.broker.topology import connection_parameters
from flowforge.config import BrokerConfig, BrokerTlsConfig
from flowforge.errors import BrokerConfigError, BrokerUnavailableError
from flowforge.store.migrate import migrate
from tests.harness import CHECKOUT
from tests.harness.resources import free_ports
from tests.harness.services import ServiceUnavailable
from tests.harness.tls import (
    MISMATCHED_HOST,
    Certificates,
    TlsPostgres,
    TlsRabbitMQ,
    make_certificates,
)
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IN_CI = os.environ.get("CI", "").lower() == "true"
COMMAND_S = 60.0
READY_S = 60.0
RUN_S = 60.0
STOP_S = 30.0
TASKS = ("fetch", "transform", "store")
#: No command runs from the config's folder: relative certificate paths must not depend on it.
ELSEWHERE = "/"


@dataclass
class Servers:
    pg: TlsPostgres
    rabbit: TlsRabbitMQ
    certs: Certificates
    dead_port: int  # nothing listens there: a dead broker node


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """A TLS-only PostgreSQL and a RabbitMQ with an amqps listener, both migrated/ready."""
    base = Path(tempfile.mkdtemp(prefix="ff-tls-"))
    base.chmod(0o755)  # the postgres / rabbitmq accounts traverse it
    certs = make_certificates(base / "certs")
    pg_port, amqp_port, dist_port, epmd_port, amqps_port, dead_port = free_ports(6)
    pg = TlsPostgres(base, pg_port, certs)
    rabbit = TlsRabbitMQ(
        base, amqp_port, dist_port, f"fftls-{os.getpid()}", amqps_port, certs, epmd_port=epmd_port
    )
    try:
        try:
            pg.start()
            rabbit.start()
        except ServiceUnavailable as exc:
            if IN_CI:
                pytest.fail(f"required service missing in CI: {exc}")
            pytest.skip(str(exc))
        migrate(pg.url)  # over verified TLS with the client certificate
        yield Servers(pg, rabbit, certs, dead_port)
    finally:
        rabbit.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


class Folder:
    """A config folder: ``certs/`` (copies of the client's files), a workflow, its handlers,
    and configs written on demand — every path in them relative to the folder."""

    def __init__(self, path: Path, servers: Servers) -> None:
        self.path = path
        self.servers = servers
        self.queue = f"flowforge.tls.{uuid.uuid4().hex[:10]}"
        (path / "certs").mkdir()
        c = servers.certs
        for source in (c.ca, c.wrong_ca, c.client_cert, c.client_key):
            shutil.copy2(source, path / "certs" / source.name)  # the key keeps mode 0600
        (path / "workflow.yaml").write_text(
            yaml.safe_dump(
                {
                    "name": "tls",
                    "tasks": [
                        {"name": name, "handler": "tls.step", "depends_on": list(TASKS[:i])[-1:]}
                        for i, name in enumerate(TASKS)
                    ],
                }
            )
        )
        (path / "tls_handlers.py").write_text(
            "from flowforge import task\n\n\n"
            '@task("tls.step")\n'
            "def step(ctx):\n"
            '    return {"task": ctx.name}\n'
        )

    def database_url(self, host: str = "127.0.0.1", **params: str) -> str:
        """The TLS-only server's URL: verify-full with the folder's CA and client certificate,
        ``params`` replacing any of them (``""`` leaves one out)."""
        query = {
            "sslmode": "verify-full",
            "sslrootcert": "certs/ca.pem",
            "sslcert": "certs/client.pem",
            "sslkey": "certs/client.key",
            **params,
        }
        url = self.servers.pg.client_url(**query)
        return url.replace("@127.0.0.1:", f"@{host}:", 1)

    def write(
        self,
        name: str,
        database_url: str | None = None,
        broker_urls: list[str] | None = None,
        tls: dict[str, str] | None = None,
    ) -> Path:
        """A config ``name``.yaml: by default every connection verified and presenting the
        client certificate, the broker list a dead amqps node and then the live one."""
        rabbit = self.servers.rabbit
        urls = broker_urls or [
            f"amqps://guest:guest@127.0.0.1:{self.servers.dead_port}/%2F",
            rabbit.amqps_url(),
        ]
        settings: dict[str, Any] = {
            "database": {"url": database_url or self.database_url()},
            "broker": {
                "url": urls,
                "queue": self.queue,
                "heartbeat_s": 10,
                "tls": tls
                or {
                    "ca_file": "certs/ca.pem",
                    "cert_file": "certs/client.pem",
                    "key_file": "certs/client.key",
                },
            },
            "handlers": ["tls_handlers"],
            "workflows": ["workflow.yaml"],
            "processes": {"workers": 1},
            "scheduler": {"poll_interval_s": 0.2},
        }
        path = self.path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path


@pytest.fixture
def folder(tmp_path: Path, servers: Servers) -> Folder:
    return Folder(tmp_path, servers)


def _env() -> dict[str, str]:
    """This environment without FlowForge's overrides (the config alone says where to go)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}
    return {
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")])),
    }


def flowforge(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``flowforge -c CONFIG ARGS`` from another directory than the config's, finished."""
    return subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), *args],
        cwd=ELSEWHERE,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
        check=False,
    )


def up(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=ELSEWHERE,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *said: str) -> str:
    """The command failed with ``code`` and a single stderr line holding every ``said``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, lines
    assert "Traceback" not in result.stderr
    for text in said:
        assert text in lines[0], lines[0]
    return lines[0]


# --- the whole tree over TLS ---------------------------------------------------------------


def test_up_runs_a_workflow_over_tls_to_both_services(folder: Folder, servers: Servers) -> None:
    config = folder.write("good")
    log = folder.path / "up.log"
    tree = up(config, log)
    try:
        wait_for(lambda: "tree ready" in log.read_text(), READY_S, 0.1, "the tree to be ready")
        triggered = flowforge(config, "trigger", "tls", "--input", "{}")
        assert triggered.returncode == 0, triggered.stderr
        run_id = triggered.stdout.strip()
        with psycopg.connect(servers.pg.url, autocommit=True) as sql:
            wait_for(lambda: _run_state(sql, run_id) == "SUCCEEDED", RUN_S, 0.1, "the run")
            executions = sql.execute(
                "SELECT t.name, a.outcome FROM task_attempts a"
                " JOIN task_runs t ON t.id = a.task_run_id WHERE t.run_id = %s",
                (run_id,),
            ).fetchall()
            sessions = _flowforge_sessions(sql)
        connections = [
            c for c in servers.rabbit.connections() if c["connection_name"] == "flowforge"
        ]
    finally:
        tree.send_signal(signal.SIGTERM)
        code = tree.wait(STOP_S)
    assert code == 0, log.read_text()[-3000:]
    assert sorted(executions) == sorted((name, "succeeded") for name in TASKS)
    # PostgreSQL saw every FlowForge session (pools and LISTEN connections of every role)
    # over TLS, authenticated by the client certificate
    roles = {name for name, _, _ in sessions}
    assert {"flowforge-scheduler", "flowforge-publisher", "flowforge-worker"} <= roles, sessions
    assert any(name.startswith("flowforge-listen-") for name in roles), sessions
    assert all(ssl and str(dn).endswith("/CN=postgres") for _, ssl, dn in sessions), sessions
    # RabbitMQ: the publisher's and the worker's connections, both TLS with the client cert
    assert len(connections) >= 2, connections
    assert all(c["ssl"] is True for c in connections), connections
    assert all("CN=postgres" in str(c["peer_cert_subject"]) for c in connections), connections


def _run_state(sql: psycopg.Connection[tuple[Any, ...]], run_id: str) -> str | None:
    row = sql.execute("SELECT state FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


def _flowforge_sessions(
    sql: psycopg.Connection[tuple[Any, ...]],
) -> list[tuple[str, bool, str | None]]:
    rows = sql.execute(
        "SELECT a.application_name, s.ssl, s.client_dn FROM pg_stat_activity a"
        " JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE 'flowforge-%'"
    ).fetchall()
    return [(str(name), bool(ssl), dn) for name, ssl, dn in rows]


# --- PostgreSQL refusals -------------------------------------------------------------------


def test_a_wrong_ca_is_refused_by_migrate_the_cli_and_up(folder: Folder) -> None:
    config = folder.write(
        "wrong-ca", database_url=folder.database_url(sslrootcert="certs/wrong-ca.pem")
    )
    said = ("cannot use the database at 127.0.0.1:", "SSL error: certificate verify failed")
    one_line_error(flowforge(config, "migrate"), 2, *said)
    one_line_error(flowforge(config, "status", str(uuid.uuid4())), 2, *said)
    log = folder.path / "up.log"
    tree = up(config, log)
    code = tree.wait(STOP_S)
    text = log.read_text()
    assert code == 3, text[-3000:]
    assert "cannot start: cannot use the database at 127.0.0.1:" in text
    assert "certificate verify failed" in text
    assert "unavailable" not in text and "reconnecting" not in text
    # refused by the first direct connection (Database.open), not after a pool's retries
    assert "psycopg.pool" not in text
    assert "Traceback" not in text


def test_a_missing_client_certificate_is_refused(folder: Folder) -> None:
    config = folder.write("no-cert", database_url=folder.database_url(sslcert="", sslkey=""))
    one_line_error(
        flowforge(config, "migrate"),
        2,
        "connection requires a valid client certificate",
        "set sslcert and sslkey",
    )


def test_a_host_name_the_certificate_does_not_name_is_refused(folder: Folder) -> None:
    config = folder.write("mismatch", database_url=folder.database_url(host=MISMATCHED_HOST))
    one_line_error(
        flowforge(config, "migrate"),
        2,
        f'does not match host name "{MISMATCHED_HOST}"',
    )


def test_verify_full_without_its_root_certificate_is_refused(folder: Folder) -> None:
    config = folder.write("no-root", database_url=folder.database_url(sslrootcert="certs/none.pem"))
    line = one_line_error(flowforge(config, "migrate"), 2, "root certificate file")
    assert str(folder.path / "certs" / "none.pem") in line  # resolved against the config folder


# --- RabbitMQ --------------------------------------------------------------------------------


def test_a_wrong_broker_ca_stops_up_with_the_boot_exit_code(folder: Folder) -> None:
    config = folder.write(
        "broker-wrong-ca",
        tls={
            "ca_file": "certs/wrong-ca.pem",
            "cert_file": "certs/client.pem",
            "key_file": "certs/client.key",
        },
    )
    log = folder.path / "up.log"
    tree = up(config, log)
    code = tree.wait(STOP_S)
    text = log.read_text()
    assert code == 3, text[-3000:]
    assert "cannot start: cannot use the broker at 127.0.0.1:" in text
    assert "the broker's certificate was refused" in text
    assert "broker.tls.ca_file" in text
    assert "Traceback" not in text


def _broker(servers: Servers, host: str = "127.0.0.1", client_cert: bool = True) -> BrokerConfig:
    """A broker config for the amqps node (at ``host``), with or without the client's files."""
    c = servers.certs
    tls = BrokerTlsConfig(str(c.ca), str(c.client_cert), str(c.client_key))
    return BrokerConfig(
        url=(servers.rabbit.amqps_url(host),),
        queue=f"flowforge.tls.{uuid.uuid4().hex[:10]}",
        tls=tls if client_cert else BrokerTlsConfig(ca_file=str(c.ca)),
    )


@pytest.mark.parametrize("side", [Consumer, ConfirmingPublisher])
def test_a_missing_broker_client_certificate_is_refused(
    servers: Servers, side: type[Consumer] | type[ConfirmingPublisher]
) -> None:
    with pytest.raises(BrokerConfigError, match="TLS") as refused:
        side(_broker(servers, client_cert=False)).connect()
    assert "client certificate" in str(refused.value)
    assert "broker.tls.cert_file" in str(refused.value)


@pytest.mark.parametrize("side", [Consumer, ConfirmingPublisher])
def test_a_broker_host_name_the_certificate_does_not_name_is_refused(
    servers: Servers, side: type[Consumer] | type[ConfirmingPublisher]
) -> None:
    with pytest.raises(BrokerConfigError, match=f"Hostname mismatch.*'{MISMATCHED_HOST}'"):
        side(_broker(servers, host=MISMATCHED_HOST)).connect()


@pytest.mark.parametrize("side", [Consumer, ConfirmingPublisher])
def test_several_nodes_a_dead_one_first(
    servers: Servers,
    side: type[Consumer] | type[ConfirmingPublisher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node list is tried in order from the process's start node: from the first here,
    a dead amqps node, then the live one, with its own server name."""
    first = functools.partial(connection_parameters, start=0)
    monkeypatch.setattr(consume, "connection_parameters", first)
    monkeypatch.setattr(publish, "connection_parameters", first)
    config = _broker(servers)
    dead = f"amqps://guest:guest@127.0.0.1:{servers.dead_port}/%2F"
    config = BrokerConfig(url=(dead, *config.url), queue=config.queue, tls=config.tls)
    assert [p.port for p in first(config)] == [servers.dead_port, servers.rabbit.amqps_port]
    before = {c["name"] for c in servers.rabbit.connections()}
    connected = side(config)
    connected.connect()
    try:
        new = [c for c in servers.rabbit.connections() if c["name"] not in before]
    finally:
        connected.close()
    assert len(new) == 1, new
    assert new[0]["ssl"] is True and new[0]["connection_name"] == "flowforge", new
    # a dead node alone is an outage, not a refusal
    with pytest.raises(BrokerUnavailableError, match="no broker node reachable"):
        side(BrokerConfig(url=(dead,), queue=config.queue, tls=config.tls)).connect()
