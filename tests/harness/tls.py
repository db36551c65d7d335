"""Private PostgreSQL and RabbitMQ that take TLS clients, and a throwaway CA for them.

:func:`make_certificates` writes one throwaway PKI (made by ``trustme``): a CA, a server
certificate for ``127.0.0.1`` only (so ``localhost`` is a name it does *not* match: the
hostname-mismatch case), a client certificate whose common name is the PostgreSQL user, and a
second CA that signed nothing here (the "wrong CA").

:class:`TlsPostgres` and :class:`TlsRabbitMQ` are the private instances of
``tests.harness.services`` with extra settings, never the machine's shared services:

- PostgreSQL has ``ssl = on`` and a ``pg_hba.conf`` of its own whose only TCP line is
  ``hostssl … cert``: a TCP client must speak TLS *and* present a client certificate signed by
  the CA whose common name is the user. Its :attr:`~TlsPostgres.url` carries
  ``sslmode=verify-full`` and the client's files, so the harness itself connects that way.
- RabbitMQ adds an ``amqps`` listener (``verify_peer``, ``fail_if_no_peer_cert``) on its own
  port; the plain listener stays (the harness's readiness check uses it), tests use
  :attr:`~TlsRabbitMQ.amqps_url`.

Each server reads its own copies of its certificate and key, owned by its account (PostgreSQL
refuses a key that others may read).

    certs = make_certificates(directory)
    pg = TlsPostgres(base_dir, pg_port, certs)
    rabbit = TlsRabbitMQ(base_dir, amqp_port, dist_port, "name", amqps_port, certs)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import trustme

from flowforge.devservices.postgres import PG_PACKAGE, PG_USER, PrivatePostgres
from flowforge.devservices.procs import (
    LOOPBACK,
    Account,
    chown,
    make_dirs,
    port_accepts,
    service_account,
    wait_until,
    write_file,
)
from flowforge.devservices.rabbitmq import RABBIT_PACKAGE, RABBIT_USER, PrivateRabbitMQ

#: A name that resolves to 127.0.0.1 but is not in the server certificate.
MISMATCHED_HOST = "localhost"
#: Seconds for the amqps listener to accept once the node is up.
AMQPS_START_TIMEOUT_S = 30.0
_PUBLIC, _PRIVATE = 0o644, 0o600


@dataclass(frozen=True)
class Certificates:
    """The PEM files of one throwaway PKI, all in ``directory`` (keys mode 0600)."""

    directory: Path
    ca: Path  # signed both servers' certificates and the client certificate
    wrong_ca: Path  # signed nothing used here: trusting only it must fail verification
    server_cert: Path  # for 127.0.0.1 only
    server_key: Path
    client_cert: Path  # common name = the PostgreSQL user (``cert`` authentication)
    client_key: Path


def make_certificates(directory: Path, client_user: str = PG_USER) -> Certificates:
    """Write a fresh CA, a server and a client certificate (and a wrong CA) in ``directory``."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    ca, wrong = trustme.CA(), trustme.CA()
    server = ca.issue_cert(LOOPBACK)
    client = ca.issue_cert(client_user, common_name=client_user)
    certs = Certificates(
        directory=directory,
        ca=directory / "ca.pem",
        wrong_ca=directory / "wrong-ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    for path, blob, mode in (
        (certs.ca, ca.cert_pem, _PUBLIC),
        (certs.wrong_ca, wrong.cert_pem, _PUBLIC),
        (certs.server_cert, server.cert_chain_pems[0], _PUBLIC),
        (certs.server_key, server.private_key_pem, _PRIVATE),
        (certs.client_cert, client.cert_chain_pems[0], _PUBLIC),
        (certs.client_key, client.private_key_pem, _PRIVATE),
    ):
        path.write_bytes(blob.bytes())
        path.chmod(mode)
    return certs


def _server_files(certs: Certificates, *modes: int) -> list[tuple[Path, int]]:
    """What a server reads, in the order CA, certificate, key; with ``modes`` for each."""
    return list(
        zip((certs.ca, certs.server_cert, certs.server_key), modes or (0, 0, 0), strict=True)
    )


def _install(certs: Certificates, directory: Path, account: Account) -> tuple[Path, Path, Path]:
    """Copy the CA, the server certificate and its key into ``directory``, owned by
    ``account`` (the key mode 0600); return their paths."""
    make_dirs(account, directory)
    copies = []
    for source, mode in _server_files(certs, _PUBLIC, _PUBLIC, _PRIVATE):
        target = directory / source.name
        shutil.copyfile(source, target)
        target.chmod(mode)
        chown(target, account)
        copies.append(target)
    return copies[0], copies[1], copies[2]


def _quoted(path: Path) -> str:
    """A path as a postgresql.conf string literal."""
    return "'" + str(path).replace("'", "''") + "'"


class TlsPostgres(PrivatePostgres):
    """A :class:`PrivatePostgres` that accepts TCP clients only over TLS with a client
    certificate (``hostssl all all 127.0.0.1/32 cert``); the Unix socket stays ``trust``."""

    def __init__(self, base_dir: Path, port: int, certs: Certificates) -> None:
        self.certs = certs
        self.tls_dir = Path(base_dir).absolute() / f"pg-{port}-tls"
        self.hba_file = self.tls_dir / "pg_hba.conf"
        ca, cert, key = (self.tls_dir / p.name for p, _ in _server_files(certs))
        super().__init__(
            base_dir,
            port,
            extra_settings=[
                "ssl = on",
                f"ssl_ca_file = {_quoted(ca)}",
                f"ssl_cert_file = {_quoted(cert)}",
                f"ssl_key_file = {_quoted(key)}",
                f"hba_file = {_quoted(self.hba_file)}",
            ],
        )

    def start(self) -> None:
        account = service_account(PG_USER, PG_PACKAGE)
        self.base_dir.mkdir(mode=0o755, exist_ok=True)
        _install(self.certs, self.tls_dir, account)
        hba = "local all all trust\nhostssl all all 127.0.0.1/32 cert\n"
        write_file(self.hba_file, hba, account, _PRIVATE)
        super().start()

    def client_url(self, dbname: str = "flowforge", **params: str | Path) -> str:
        """A libpq URL of ``dbname`` on this server with ``params`` as its query (values
        percent-encoded; a parameter given as ``""`` is left out)."""
        query = "&".join(f"{k}={quote(str(v), safe='/')}" for k, v in params.items() if v != "")
        return f"postgresql://{PG_USER}@{LOOPBACK}:{self.port}/{dbname}" + (
            f"?{query}" if query else ""
        )

    def _verified(self, dbname: str) -> str:
        c = self.certs
        return self.client_url(
            dbname,
            sslmode="verify-full",
            sslrootcert=c.ca,
            sslcert=c.client_cert,
            sslkey=c.client_key,
        )

    @property
    def url(self) -> str:
        """The ``flowforge`` database over verified TLS with the client certificate."""
        return self._verified("flowforge")

    @property
    def admin_url(self) -> str:
        """The ``postgres`` database over verified TLS with the client certificate."""
        return self._verified("postgres")


class TlsRabbitMQ(PrivateRabbitMQ):
    """A :class:`PrivateRabbitMQ` with an ``amqps`` listener on ``amqps_port`` that verifies
    clients (``verify_peer``, ``fail_if_no_peer_cert``) against the CA of ``certs``."""

    def __init__(
        self,
        base_dir: Path,
        amqp_port: int,
        dist_port: int,
        node_name: str,
        amqps_port: int,
        certs: Certificates,
        *,
        epmd_port: int | None = None,
    ) -> None:
        self.certs = certs
        self.amqps_port = amqps_port
        self.tls_dir = Path(base_dir).absolute() / f"rabbit-{node_name}-tls"
        ca, cert, key = (self.tls_dir / p.name for p, _ in _server_files(certs))
        super().__init__(
            base_dir,
            amqp_port,
            dist_port,
            node_name,
            epmd_port=epmd_port,
            extra_config=[
                f"listeners.ssl.default = {LOOPBACK}:{amqps_port}",
                f"ssl_options.cacertfile = {ca}",
                f"ssl_options.certfile = {cert}",
                f"ssl_options.keyfile = {key}",
                "ssl_options.verify = verify_peer",
                "ssl_options.fail_if_no_peer_cert = true",
            ],
        )

    def start(self) -> None:
        self.base_dir.mkdir(mode=0o755, exist_ok=True)
        _install(self.certs, self.tls_dir, service_account(RABBIT_USER, RABBIT_PACKAGE))
        super().start()
        wait_until(
            lambda: port_accepts(self.amqps_port),
            AMQPS_START_TIMEOUT_S,
            f"amqps port {self.amqps_port}",
        )

    def amqps_url(self, host: str = LOOPBACK) -> str:
        """``amqps://`` URL of the default vhost as ``guest`` (allowed from loopback only)."""
        return f"amqps://guest:guest@{host}:{self.amqps_port}/%2F"

    def connections(self) -> list[dict[str, Any]]:
        """Every client connection as ``rabbitmqctl list_connections`` reports it: ``name``,
        ``ssl`` (bool), ``peer_cert_subject`` (the client certificate's) and the client's
        ``connection_name`` (None if it gave none)."""
        out = self.rabbitmqctl(
            "list_connections",
            "--formatter",
            "json",
            "name",
            "ssl",
            "peer_cert_subject",
            "client_properties",
        )
        rows = json.loads(out or "[]")
        found = []
        for row in rows:
            # client_properties is a list of [key, type, value] triples
            properties = {p[0]: p[-1] for p in row.pop("client_properties", []) or []}
            found.append({**row, "connection_name": properties.get("connection_name")})
        return found
