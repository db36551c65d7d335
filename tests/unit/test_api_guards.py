"""The api's guards through their seams, without services (real child: integration/api_hardening).

- ``api.read_access``, ``api.allowed_hosts`` and the connection limits are validated on load,
  naming the key; the default allowed hosts are the listen host and localhost;
- the ``Host`` check's matching (port or none, case, ``*``);
- ``/health/ready`` runs its checks at most once per ``api.ready_cache_s``, also under a storm
  of concurrent probes;
- the access log: a line per mutation and per refused authentication, none per successful
  read, escaped, without the token or the query string;
- a connection limit that does not fit the open-file limit stops the boot.
"""

from __future__ import annotations

import logging
import resource
import textwrap
import threading
from pathlib import Path

import falcon
import falcon.testing
import pytest

from flowforge.api import errors
from flowforge.api.health import Ready
from flowforge.api.security import AccessLog, HostCheck, TokenAuth
from flowforge.api.server import SPARE_FDS, check_fd_limit
from flowforge.config import ApiConfig, ReadAccess, load_config
from flowforge.errors import BootError, ConfigError

TOKEN = "unit-secret-token"


def load_api(tmp_path: Path, body: str) -> ApiConfig:
    path = tmp_path / "flowforge.yaml"
    path.write_text("api:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    api = load_config(path).api
    assert api is not None
    return api


# ------------------------------------------------------------------ config


def test_the_api_defaults_guard_reads_and_name_the_listen_host_and_localhost(
    tmp_path: Path,
) -> None:
    api = load_api(tmp_path, "listen: 10.0.0.5:9000\n")
    assert api.read_access is ReadAccess.TOKEN
    assert set(api.hosts()) == {
        "10.0.0.5",
        "10.0.0.5:9000",
        "localhost",
        "localhost:9000",
        "127.0.0.1",
        "127.0.0.1:9000",
        "[::1]",
        "[::1]:9000",
    }
    assert (api.request_head_timeout_s, api.request_body_timeout_s) == (5.0, 60.0)
    assert api.max_connections_per_client == 20
    assert (api.connection_limit, api.threads, api.ready_cache_s) == (200, 16, 2.0)


def test_the_new_api_keys_load(tmp_path: Path) -> None:
    api = load_api(
        tmp_path,
        """\
        read_access: open
        allowed_hosts: [FlowForge.example, "other.example:8443", "[::1]"]
        request_head_timeout_s: 2.5
        max_connections_per_client: 0
        connection_limit: 500
        threads: 8
        ready_cache_s: 0
        """,
    )
    assert api.read_access is ReadAccess.OPEN
    assert api.hosts() == ("flowforge.example", "other.example:8443", "[::1]")
    assert (api.max_connections_per_client, api.connection_limit, api.threads) == (0, 500, 8)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("read_access: public", "api.read_access: must be one of token, open"),
        ("read_access: true", "api.read_access"),
        ("allowed_hosts: []", "allowed_hosts needs at least one host"),
        ("allowed_hosts: example.com", "api.allowed_hosts: expected a list"),
        ("allowed_hosts: ['http://example.com']", "'http://example.com' is not a host"),
        ("allowed_hosts: ['example.com/ui']", "is not a host"),
        ("allowed_hosts: ['']", "is not a host"),
        ("allowed_hosts: ['a b']", "is not a host"),
        ("allowed_hosts: ['example.com:']", "is not a host"),
        ("allowed_hosts: [5]", "api.allowed_hosts[0]: expected a string"),
        ("request_head_timeout_s: 0", "request_head_timeout_s must be a positive"),
        ("request_head_timeout_s: .nan", "api.request_head_timeout_s: must be a finite"),
        ("request_body_timeout_s: -1", "request_body_timeout_s must be a positive"),
        ("max_connections_per_client: -1", "max_connections_per_client must be 0"),
        ("connection_limit: 0", "connection_limit must be a positive"),
        ("threads: 0", "threads must be a positive"),
        ("threads: 1.5", "api.threads: expected an integer"),
        ("ready_cache_s: -1", "ready_cache_s must be 0"),
    ],
)
def test_a_bad_api_value_is_refused_naming_its_key(tmp_path: Path, body: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_api(tmp_path, body + "\n")
    assert words in str(info.value)
    assert "flowforge.yaml" in str(info.value)


# ------------------------------------------------------------------ Host check


@pytest.mark.parametrize(
    ("hosts", "host", "allowed"),
    [
        (("localhost",), "localhost", True),
        (("localhost",), "LocalHost:8080", True),  # no port in the entry: any port
        (("localhost:8080",), "localhost:8080", True),
        (("localhost:8080",), "localhost:8081", False),
        (("localhost:8080",), "localhost", False),
        (("[::1]",), "[::1]:8080", True),
        (("127.0.0.1",), "127.0.0.1.evil.example", False),
        (("127.0.0.1",), "evil.example:127.0.0.1", False),
        (("example.com",), "sub.example.com", False),
        (("example.com",), "", False),
        (("*",), "anything.example:1", True),
    ],
)
def test_the_host_check_matches_a_name_with_or_without_its_port(
    hosts: tuple[str, ...], host: str, allowed: bool
) -> None:
    assert HostCheck(hosts).allows(host) is allowed


# ------------------------------------------------------------------ the readiness cache


class CountingChecks:
    """A stand-in for health.Checks that counts its runs (each would open an AMQP
    connection) and can be held open to let probes pile up."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __call__(self) -> dict[str, str]:
        self.runs += 1
        self.entered.set()
        assert self.release.wait(10)
        return {"postgres": "ok", "rabbitmq": "ok"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ready_client(checks: CountingChecks, cache_s: float, clock: Clock) -> falcon.testing.TestClient:
    app = falcon.App()
    app.add_route("/health/ready", Ready(checks, cache_s=cache_s, clock=clock))
    return falcon.testing.TestClient(app)


def test_ready_runs_its_checks_at_most_once_per_cache_interval() -> None:
    checks, clock = CountingChecks(), Clock()
    client = ready_client(checks, 2.0, clock)
    for _ in range(50):
        reply = client.simulate_get("/health/ready")
        assert reply.status_code == 200 and reply.json["rabbitmq"] == "ok"
    assert checks.runs == 1
    clock.now += 1.99
    client.simulate_get("/health/ready")
    assert checks.runs == 1
    clock.now += 0.01
    for _ in range(10):
        client.simulate_get("/health/ready")
    assert checks.runs == 2
    uncached = CountingChecks()
    bare = ready_client(uncached, 0.0, clock)
    for _ in range(3):
        bare.simulate_get("/health/ready")
    assert uncached.runs == 3


def test_a_storm_of_concurrent_probes_shares_one_check() -> None:
    checks, clock = CountingChecks(), Clock()
    client = ready_client(checks, 2.0, clock)
    checks.release.clear()  # the first check hangs (a broker slow to answer)
    statuses: list[int] = []

    def probe() -> None:
        statuses.append(client.simulate_get("/health/ready").status_code)

    threads = [threading.Thread(target=probe) for _ in range(20)]
    for thread in threads:
        thread.start()
    assert checks.entered.wait(10)
    checks.release.set()
    for thread in threads:
        thread.join(10)
    assert statuses == [200] * 20
    assert checks.runs == 1


# ------------------------------------------------------------------ the access log


def logged_app() -> falcon.testing.TestClient:
    class Resource:
        def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
            resp.media = {"ok": True}

        def on_post(self, _req: falcon.Request, resp: falcon.Response) -> None:
            resp.status = falcon.HTTP_201
            resp.media = {"ok": True}

    app = falcon.App(middleware=[AccessLog(), TokenAuth(TOKEN, ReadAccess.TOKEN)])
    app.set_error_serializer(errors.serialize_error)
    app.add_route("/api/v1/things", Resource())
    app.add_route("/api/v1/things/{name}", Resource())
    return falcon.testing.TestClient(app)


def test_the_access_log_has_mutations_and_refusals_never_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = logged_app()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with caplog.at_level(logging.INFO, logger="flowforge.api.access"):
        client.simulate_post("/api/v1/things", headers=auth, query_string=f"token={TOKEN}")
        client.simulate_get("/api/v1/things", headers=auth)  # a read that succeeds
        client.simulate_get("/api/v1/things")
        client.simulate_post("/api/v1/things", headers={"Authorization": "Bearer wrong"})
        client.simulate_get("/api/v1/things/a\nINFO forged\x1b[2J")
    lines = [r.getMessage() for r in caplog.records if r.name == "flowforge.api.access"]
    assert lines == [
        "POST /api/v1/things 201 from 127.0.0.1",
        "GET /api/v1/things 401 from 127.0.0.1",
        "POST /api/v1/things 403 from 127.0.0.1",
        "GET /api/v1/things/a\\nINFO forged\\x1b[2J 401 from 127.0.0.1",
    ]
    first = caplog.records[0]
    assert (first.action, first.status, first.client) == ("api_access", 201, "127.0.0.1")  # type: ignore[attr-defined]
    text = caplog.text + repr([vars(r) for r in caplog.records])
    assert TOKEN not in text and "wrong" not in text and "Bearer" not in text


# ------------------------------------------------------------------ the open-file limit


def test_a_connection_limit_over_the_open_file_limit_stops_the_boot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 4096))
    check_fd_limit(1024 - SPARE_FDS)
    with pytest.raises(BootError) as info:
        check_fd_limit(1024 - SPARE_FDS + 1)
    assert "api.connection_limit 961" in str(info.value) and "ulimit -n" in str(info.value)
