"""The api's guards as a TLS-terminating reverse proxy reaches them (docs/operations.md, "Behind
a reverse proxy"): the proxy passes the public ``Host`` on, the browser's ``Origin`` is the
public https origin, and the api itself speaks plain HTTP on a private address.

The requests are what nginx sends with the documented ``proxy_set_header Host $host`` (and what
it sends without it: ``Host`` is then the upstream's address, and a mutation from the dashboard
is refused as cross-origin — the misconfiguration the docs warn about).
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import falcon
import falcon.testing
import pytest

from flowforge.api import errors
from flowforge.api.app import guards
from flowforge.config import load_config
from flowforge.errors import ConfigError

TOKEN = "proxy-test-token"
PUBLIC = "flow.example.com"


def proxied_app(
    tmp_path: Path, extra_host: str | None = None, trusted: list[str] | None = None
) -> falcon.testing.TestClient:
    hosts = [PUBLIC] if extra_host is None else [PUBLIC, extra_host]
    path = tmp_path / "flowforge.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            api:
              listen: 127.0.0.1:8080
              allowed_hosts: {hosts}
              max_connections_per_client: 0
              trusted_proxies: {trusted or []}
            """
        )
    )
    api = load_config(path).api
    assert api is not None

    class Runs:
        def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
            resp.media = {"runs": []}

        def on_post(self, _req: falcon.Request, resp: falcon.Response) -> None:
            resp.status = falcon.HTTP_201
            resp.media = {"id": "r1"}

    app = falcon.App(middleware=guards(TOKEN, api))
    app.set_error_serializer(errors.serialize_error)
    app.add_route("/api/v1/runs", Runs())
    return falcon.testing.TestClient(app)


def browser_post(host: str, origin: str) -> dict[str, str]:
    """The headers of a dashboard mutation after the proxy (X-Forwarded-* as nginx adds them)."""
    return {
        "Host": host,
        "Origin": origin,
        "Sec-Fetch-Site": "same-origin",
        "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/json",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-For": "203.0.113.7",
    }


def test_a_dashboard_mutation_through_a_tls_terminating_proxy_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = proxied_app(tmp_path)
    with caplog.at_level(logging.INFO, logger="flowforge.api.access"):
        done = client.simulate_post(
            "/api/v1/runs", headers=browser_post(PUBLIC, f"https://{PUBLIC}"), body="{}"
        )
    assert done.status_code == 201, done.text
    # the access log names the proxy, not the browser: X-Forwarded-For is not trusted unless
    # api.trusted_proxies names the proxy
    assert [r.getMessage() for r in caplog.records] == ["POST /api/v1/runs 201 from 127.0.0.1"]


def logged_clients(
    client: falcon.testing.TestClient,
    caplog: pytest.LogCaptureFixture,
    forwarded: str | None,
    peer: str = "127.0.0.1",
) -> list[tuple[str, str | None]]:
    """(client, proxy) of the access-log line of one mutation from ``peer`` with
    ``X-Forwarded-For: forwarded`` (no such header with None)."""
    headers = browser_post(PUBLIC, f"https://{PUBLIC}")
    del headers["X-Forwarded-For"]
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flowforge.api.access"):
        done = client.simulate_post("/api/v1/runs", headers=headers, body="{}", remote_addr=peer)
    assert done.status_code == 201, done.text
    return [(r.__dict__["client"], r.__dict__.get("proxy")) for r in caplog.records]


@pytest.mark.parametrize(
    ("peer", "forwarded", "expected"),
    [
        # the proxy appended the browser's address
        ("127.0.0.1", "203.0.113.7", ("203.0.113.7", "127.0.0.1")),
        # what the client wrote itself, left of what the proxy appended, is not believed
        ("127.0.0.1", "198.51.100.1, 203.0.113.7", ("203.0.113.7", "127.0.0.1")),
        # through two trusted proxies: the first address outside them, from the right
        ("127.0.0.1", "203.0.113.7, 10.1.2.3", ("203.0.113.7", "127.0.0.1")),
        # every hop trusted: the leftmost (an internal caller)
        ("127.0.0.1", "10.9.9.9, 10.1.2.3", ("10.9.9.9", "127.0.0.1")),
        # text that is no address ends the walk at the last address vouched for
        ("127.0.0.1", "203.0.113.7\u2028forged, nonsense, 10.1.2.3", ("10.1.2.3", "127.0.0.1")),
        ("127.0.0.1", "not-an-address", ("127.0.0.1", "127.0.0.1")),
        # IPv6, bracketed or not, written canonically
        ("127.0.0.1", "[2001:DB8::1]", ("2001:db8::1", "127.0.0.1")),
        # no header: the peer, no proxy
        ("127.0.0.1", None, ("127.0.0.1", None)),
        # a peer that is no trusted proxy: the header is ignored whatever it says
        ("192.0.2.50", "203.0.113.7", ("192.0.2.50", None)),
    ],
)
def test_a_trusted_proxy_s_x_forwarded_for_names_the_client_in_the_access_log(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    peer: str,
    forwarded: str | None,
    expected: tuple[str, str | None],
) -> None:
    client = proxied_app(tmp_path, trusted=["127.0.0.1", "10.0.0.0/8"])
    assert logged_clients(client, caplog, forwarded, peer) == [expected]
    message = caplog.records[0].getMessage()
    tail = f"from {expected[0]}" + ("" if expected[1] is None else f" via {expected[1]}")
    assert message == f"POST /api/v1/runs 201 {tail}"


def test_without_trusted_proxies_x_forwarded_for_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = proxied_app(tmp_path)
    assert logged_clients(client, caplog, "203.0.113.7") == [("127.0.0.1", None)]


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "proxy.example", "", "10.0.0.1:80"])
def test_a_trusted_proxy_that_is_no_address_or_network_is_refused(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "flowforge.yaml"
    path.write_text(f"api:\n  trusted_proxies: [{bad!r}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value) == (
        f"{path}: api: trusted_proxies: {bad!r} is not an IP address or network"
        " (e.g. 10.0.0.5 or 10.0.0.0/8)"
    )


def test_through_the_proxy_a_read_needs_the_token_and_the_public_host(tmp_path: Path) -> None:
    client = proxied_app(tmp_path)
    auth = {"Host": PUBLIC, "Authorization": f"Bearer {TOKEN}"}
    assert client.simulate_get("/api/v1/runs", headers=auth).status_code == 200
    assert client.simulate_get("/api/v1/runs", headers={"Host": PUBLIC}).status_code == 401
    other = client.simulate_get("/api/v1/runs", headers={**auth, "Host": "rebound.example"})
    assert other.status_code == 421


def test_a_proxy_that_does_not_pass_host_on_gets_dashboard_mutations_refused(
    tmp_path: Path,
) -> None:
    # nginx's default: Host is the upstream's address, which allowed_hosts does not name
    client = proxied_app(tmp_path)
    upstream = browser_post("127.0.0.1:8080", f"https://{PUBLIC}")
    misdirected = client.simulate_post("/api/v1/runs", headers=upstream, body="{}")
    assert misdirected.status_code == 421
    # naming the upstream's address too does not help the dashboard: its Origin is the public
    # name, which is not the Host the api sees
    client = proxied_app(tmp_path, extra_host="127.0.0.1:8080")
    refused = client.simulate_post("/api/v1/runs", headers=upstream, body="{}")
    assert refused.status_code == 403
    assert refused.json == {"error": "cross-origin request refused"}


def test_another_site_is_refused_through_the_proxy_too(tmp_path: Path) -> None:
    client = proxied_app(tmp_path)
    forged = browser_post(PUBLIC, "https://evil.example")
    assert client.simulate_post("/api/v1/runs", headers=forged, body="{}").status_code == 403
    cross_site = {**browser_post(PUBLIC, f"https://{PUBLIC}"), "Sec-Fetch-Site": "cross-site"}
    assert client.simulate_post("/api/v1/runs", headers=cross_site, body="{}").status_code == 403
