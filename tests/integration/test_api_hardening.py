"""The api against hostile or careless clients, over real sockets.

Every request goes over a socket to the api's server: the api role served from this process
(``api_here``, tests/api_here.py), or, where the process itself matters (its log, a flood
measured against a process of its own), a real api child (`flowforge role api`, started the way
tests/integration/test_api.py starts it). Proven here:

- ``api.read_access: token`` (the default): every read of ``/api/...`` and ``/metrics`` needs the
  bearer token (401 without, 403 wrong); the probes, the dashboard's pages and assets stay open
  and the readiness body holds no secret; ``open`` lets reads through and still guards mutations;
- ``api.allowed_hosts``: a request addressed to another host name (DNS rebinding) is a JSON 421
  before any route runs; the probes are exempt;
- slow clients: with 120 connections that trickle their request heads (and come back when
  closed), ``/health/live`` answers within a second and a read with the token answers, whether the
  connections come from one address (the per-client cap) or from many (the connection limit);
  a head that does not arrive within ``api.request_head_timeout_s`` (or a body within
  ``api.request_body_timeout_s``) gets a 408 and its connection closes, while a kept-alive
  connection idle between requests is left alone; at the per-client
  cap a new connection displaces the one that has waited longest, or gets a 429 when every one
  of them is inside a request;
- the access log: one line per mutating request and per refused authentication, with the path's
  control characters escaped, and never the token or the query string.

Every socket a test opens is closed by it; every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest

from tests.api_client import (
    TOKEN,
    UNKNOWN_ID,
    Api,
    Reply,
    StartApi,
    assert_json_error,
    count_runs,
    start_api,
)
from tests.e2e import Stack
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: How fast a probe must answer under a flood of slow clients (the issue's bar).
PROBE_BAR_S = 1.0
#: How long a flood lasts (bounded): shorter than the default 5 s head deadline, so what keeps
#: the probes answering is the cap or the limit, not the deadline.
FLOOD_S = 4.0
#: A slow client sends one more header line this often.
TRICKLE_EVERY_S = 0.5
SLOW_CLIENTS = 120
READS = [
    "/api/v1/runs",
    "/api/v1/dead",
    "/api/v1/overview",
    "/api/v1/processes",
    "/api/v1/schedules",
    "/metrics",
]
OPEN_PAGES = [
    "/ui/",
    "/ui/runs",
    "/ui/schedules",
    "/ui/static/app.js",
    "/ui/static/schedules.js",
    "/ui/static/style.css",
]
READY_KEYS = {"status", "postgres", "rabbitmq", "scheduler", "publisher", "worker"}


def without_token(api: Api, method: str, path: str, **kwargs: Any) -> Reply:
    return api.request(method, path, auth=False, **kwargs)


def with_host(api: Api, host: str, method: str = "GET", path: str = "/api/v1/runs") -> Reply:
    return api.request(method, path, headers={"Host": host})


# ------------------------------------------------------------------ read access


def test_reads_need_the_token_by_default_and_the_probes_and_pages_stay_open(
    api_here: StartApi, sql: Sql
) -> None:
    api = api_here()
    for path in [*READS, f"/api/v1/runs/{UNKNOWN_ID}", "/api/v1/dead?limit=1"]:
        missing = without_token(api, "GET", path)
        assert_json_error(missing, 401)
        assert "bearer" in missing.headers.get("WWW-Authenticate", "").lower()
        wrong = api.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}x"})
        assert "invalid token" in assert_json_error(wrong, 403)
        assert without_token(api, "HEAD", path).status == 401, path
    for path in READS:
        assert api.get(path).status == 200, path
    assert_json_error(api.get(f"/api/v1/runs/{UNKNOWN_ID}"), 404)
    # what holds no data stays open: the probes, the dashboard's shell and assets
    assert without_token(api, "GET", "/health/live").json() == {"status": "ok"}
    for path in OPEN_PAGES:
        assert without_token(api, "GET", path).status == 200, path
    ready = without_token(api, "GET", "/health/ready", timeout=15)
    assert ready.status in (200, 503)
    body = ready.json()
    assert set(body) == READY_KEYS, body  # component names and ok/error, nothing else
    assert set(body.values()) <= {"ok", "error"}, body
    assert count_runs(sql) == 0


def test_with_read_access_open_reads_need_no_token_and_mutations_still_do(
    api_here: StartApi, sql: Sql
) -> None:
    api = api_here(read_access="open")
    for path in READS:
        assert without_token(api, "GET", path).status == 200, path
    body = {"workflow": "api-record", "input": {}}
    assert_json_error(without_token(api, "POST", "/api/v1/runs", body=body), 401)
    assert count_runs(sql) == 0
    assert api.post("/api/v1/runs", body).status == 201


# ------------------------------------------------------------------ allowed hosts


def test_a_host_not_allowed_gets_a_json_421_before_any_route_runs(
    api_here: StartApi, sql: Sql
) -> None:
    api = api_here()
    port = api.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        assert "not served here" in assert_json_error(with_host(api, host), 421)
        assert_json_error(with_host(api, host, "GET", "/ui/"), 421)
        created = api.request(
            "POST",
            "/api/v1/runs",
            {"workflow": "api-record", "input": {}},
            headers={"Host": host},
        )
        assert_json_error(created, 421)
    assert count_runs(sql) == 0  # no route ran
    # the default: the listen address and localhost, with and without the port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", "[::1]"):
        assert with_host(api, host).status == 200, host
    # orchestrators probe by whatever address they use: the probes are exempt
    assert with_host(api, "10.1.2.3:8080", path="/health/live").status == 200


def test_allowed_hosts_replaces_the_default(api_here: StartApi) -> None:
    api = api_here(allowed_hosts=["flowforge.example", "other.example:8443"])
    assert with_host(api, f"flowforge.example:{api.port}").status == 200
    assert with_host(api, "flowforge.example").status == 200
    assert with_host(api, "other.example:8443").status == 200
    assert_json_error(with_host(api, "other.example:8444"), 421)
    assert_json_error(with_host(api, f"localhost:{api.port}"), 421)


# ------------------------------------------------------------------ slow clients


def server_closed(sock: socket.socket) -> bool:
    """Whether the server is done with ``sock``: it answered (408, 429) or closed it. Never
    waits (a socket with a timeout would wait for input even with MSG_DONTWAIT)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)
    return True  # end of input, or an answer the server closes after


class Slowloris:
    """``n`` connections to the api that never finish a request head: each sends a request
    line, then one header line per :meth:`trickle`; one the server closed is opened again (the
    attacker does not give up). Connection ``i`` comes from ``sources[i % len(sources)]``."""

    def __init__(self, port: int, n: int, sources: Sequence[str] = ("127.0.0.1",)) -> None:
        self.port = port
        self.sources = sources
        self.socks: list[socket.socket] = []
        self.reopened = 0
        for i in range(n):
            self.socks.append(self._open(i))

    def _open(self, i: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(5)
            sock.bind((self.sources[i % len(self.sources)], 0))
            sock.connect(("127.0.0.1", self.port))  # completes in the backlog if not accepted
            sock.sendall(b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            sock.close()
            raise
        return sock

    def trickle(self) -> None:
        for i, sock in enumerate(self.socks):
            if server_closed(sock):
                sock.close()
                self.socks[i] = self._open(i)
                self.reopened += 1
                continue
            with contextlib.suppress(OSError):
                sock.send(b"X-Slow: 1\r\n")

    def open_count(self) -> int:
        return sum(not server_closed(sock) for sock in self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@contextlib.contextmanager
def slowloris(port: int, n: int, sources: Sequence[str] = ("127.0.0.1",)) -> Iterator[Slowloris]:
    flood = Slowloris(port, n, sources)
    try:
        yield flood
    finally:
        flood.close()


def probe_under(flood: Slowloris, api: Api) -> list[tuple[int, float]]:
    """Probe ``/health/live`` again and again for FLOOD_S while the flood trickles: each
    probe's (status, seconds). A probe slower than PROBE_BAR_S fails with a timeout."""
    probes: list[tuple[int, float]] = []
    end = time.monotonic() + FLOOD_S
    trickled = 0.0
    while time.monotonic() < end:
        if time.monotonic() - trickled >= TRICKLE_EVERY_S:
            flood.trickle()
            trickled = time.monotonic()
        started = time.monotonic()
        reply = without_token(api, "GET", "/health/live", timeout=PROBE_BAR_S)
        probes.append((reply.status, time.monotonic() - started))
    return probes


def assert_answers_under(flood: Slowloris, api: Api) -> None:
    probes = probe_under(flood, api)
    assert len(probes) >= 10, probes
    assert all(status == 200 for status, _ in probes), probes
    slowest = max(seconds for _, seconds in probes)
    assert slowest < PROBE_BAR_S, slowest
    started = time.monotonic()
    read = api.request("GET", "/api/v1/runs", timeout=PROBE_BAR_S)
    assert read.status == 200 and time.monotonic() - started < PROBE_BAR_S
    assert flood.reopened > 0  # the flood really was pressing: the api closed some of it


@pytest.mark.slow  # a 4 s flood of 120 connections
def test_probes_and_reads_answer_while_120_slow_clients_trickle_headers(stack: Stack) -> None:
    """One address: the per-client cap (20) keeps the flood to 20 connections, the longest
    waiting of which makes room for each new one."""
    api = start_api(stack)
    with slowloris(api.port, SLOW_CLIENTS) as flood:
        assert_answers_under(flood, api)
        # the backlog the last round reopened into is accepted, each displacing an older one
        wait_for(lambda: flood.open_count() <= 20, timeout=5, interval=0.1, what="the cap")


@pytest.mark.slow  # a 4 s flood of 120 connections
def test_at_the_connection_limit_the_longest_waiting_connection_makes_room(
    stack: Stack,
) -> None:
    """120 addresses (127.0.0.2 ...), one connection each, against a limit of 50: no cap
    applies, the connection limit does."""
    api = start_api(stack, connection_limit=50)
    sources = [f"127.0.0.{i}" for i in range(2, 2 + SLOW_CLIENTS)]
    with slowloris(api.port, SLOW_CLIENTS, sources) as flood:
        assert_answers_under(flood, api)
        wait_for(lambda: flood.open_count() < 50, timeout=5, interval=0.1, what="the limit")


def read_answer(sock: socket.socket, timeout: float) -> Reply:
    sock.settimeout(timeout)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return Reply(response.status, response.headers, response.read())


def test_a_request_head_past_its_deadline_gets_408_and_its_connection_closes(
    api_here: StartApi,
) -> None:
    api = api_here(request_head_timeout_s=1)
    with contextlib.ExitStack() as sockets:
        trickling = sockets.enter_context(socket.create_connection(("127.0.0.1", api.port), 5))
        silent = sockets.enter_context(socket.create_connection(("127.0.0.1", api.port), 5))
        started = time.monotonic()
        trickling.sendall(b"GET /health/live HTTP/1.1\r\n")
        trickle_until_answered(trickling, b"x", "the trickling connection's answer")
        took = time.monotonic() - started
        assert 1.0 <= took < 4.0, took
        reply = read_answer(trickling, 5)
        assert "did not arrive within 1 s" in assert_json_error(reply, 408)
        assert trickling.recv(1) == b""  # and closed
        # a connection that never sends a byte meets the same deadline
        wait_for(lambda: server_closed(silent), timeout=5, interval=0.1, what="the silent one")
        assert_json_error(read_answer(silent, 5), 408)
        # a kept-alive connection idle between requests is not waiting for a head
        kept = sockets.enter_context(socket.create_connection(("127.0.0.1", api.port), 5))
        request = (
            f"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        )
        kept.sendall(request.encode())
        first = http.client.HTTPResponse(kept)
        first.begin()
        assert first.status == 200 and first.read()
        idle_from = time.monotonic()
        # watched for closing over more than twice the deadline (plus its 1 s granularity)
        wait_for(
            lambda: server_closed(kept) or time.monotonic() - idle_from > 2.5,
            timeout=5,
            interval=0.05,
            what="the kept-alive connection to be closed or the window to pass",
        )
        assert not server_closed(kept)
        kept.sendall(request.encode())
        second = http.client.HTTPResponse(kept)
        second.begin()
        assert second.status == 200 and second.read()


def test_a_request_body_past_its_deadline_gets_408_and_its_connection_closes(
    api_here: StartApi, sql: Sql
) -> None:
    """A head sent at once, then a body a byte at a time: inside a request, so no cap can
    close it; the body deadline does."""
    api = api_here(request_body_timeout_s=1)
    head = (
        f"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    ).encode()
    with socket.create_connection(("127.0.0.1", api.port), 5) as sock:
        started = time.monotonic()
        sock.sendall(head)
        trickle_until_answered(sock, b" ", "the trickled body's answer")
        took = time.monotonic() - started
        assert 1.0 <= took < 4.0, took
        reply = read_answer(sock, 5)
        assert "body did not arrive within 1 s" in assert_json_error(reply, 408)
    assert count_runs(sql) == 0


def trickle_until_answered(sock: socket.socket, byte: bytes, what: str) -> None:
    """Send ``byte`` every 0.1 s (never idle, never done) until the server answers or closes
    ``sock``; fail after 10 s."""

    def answered() -> bool:
        if server_closed(sock):
            return True
        with contextlib.suppress(OSError):
            sock.send(byte)
        return False

    wait_for(answered, timeout=10, interval=0.1, what=what)


def settle(api: Api) -> None:
    """A whole request from another address (no cap shared), answered: by then the server
    has read whatever reached it before, and closed the connections clients closed before."""
    with socket.create_connection(("127.0.0.1", api.port), 5, ("127.0.0.2", 0)) as other:
        other.sendall(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(other, 5).status == 200


def partial_heads(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), 5)
        socks.append(sock)
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")
    return socks


def test_at_the_per_client_cap_a_new_connection_displaces_the_longest_waiting_one(
    api_here: StartApi,
) -> None:
    api = api_here(max_connections_per_client=3)
    settle(api)  # the probes that saw it start are gone
    socks = partial_heads(api.port, 3)
    # the server must have read all three heads' first bytes: one not read yet counts as an
    # idle connection, which is displaced first (seen on a loaded machine: socks[2] went)
    settle(api)
    try:
        wait_for(
            lambda: not any(server_closed(s) for s in socks),
            timeout=2,
            interval=0.05,
            what="three partial heads held open",
        )
        assert without_token(api, "GET", "/health/live").status == 200
        wait_for(
            lambda: server_closed(socks[0]),
            timeout=5,
            interval=0.05,
            what="the oldest partial head to be closed",
        )
        assert not server_closed(socks[1]) and not server_closed(socks[2])
    finally:
        for sock in socks:
            sock.close()


def test_at_the_connection_limit_a_new_connection_closes_the_longest_waiting_partial_head(
    api_here: StartApi,
) -> None:
    """The connection limit's rule without a flood (the flood is the slow test above): more
    partial heads than the limit holds, each from its own address so no per-client cap
    applies; each one accepted past the limit closes the oldest, and a client that sends
    its request at once is answered."""
    limit = 6
    # no head deadline within the test: only the limit can close a connection
    api = api_here(connection_limit=limit, request_head_timeout_s=60)
    settle(api)
    socks: list[socket.socket] = []
    try:
        for i in range(limit):  # the listening socket holds a slot too: more than fit
            sock = socket.create_connection(("127.0.0.1", api.port), 5, (f"127.0.1.{1 + i}", 0))
            socks.append(sock)
            sock.sendall(b"GET /health/live HTTP/1.1\r\n")
        settle(api)  # queued behind every partial head: accepted after each of them
        wait_for(
            lambda: server_closed(socks[0]),
            timeout=5,
            interval=0.05,
            what="the oldest partial head to be closed",
        )
        assert not server_closed(socks[-1])
        assert sum(not server_closed(s) for s in socks) < limit
    finally:
        for sock in socks:
            sock.close()


def test_at_the_per_client_cap_a_new_connection_is_refused_when_every_one_is_busy(
    api_here: StartApi, sql: Sql
) -> None:
    """Three connections inside a request (head sent, body on its way) cannot make room: the
    fourth gets a JSON 429, and the three are untouched."""
    api = api_here(max_connections_per_client=3)
    head = (
        f"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    ).encode()
    busy = []
    settle(api)
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", api.port), 5)
            busy.append(sock)
            sock.sendall(head)
        settle(api)  # the server has read those heads
        with socket.create_connection(("127.0.0.1", api.port), 5) as extra:
            reply = read_answer(extra, 5)
        assert "too many connections from 127.0.0.1" in assert_json_error(reply, 429)
        assert not any(server_closed(s) for s in busy)
        assert count_runs(sql) == 0
    finally:
        for sock in busy:
            sock.close()


# ------------------------------------------------------------------ access log


def test_mutations_and_refused_authentication_are_logged_without_the_token(
    stack: Stack, sql: Sql
) -> None:
    api = start_api(stack)
    assert api.process is not None
    body = {"workflow": "api-record", "input": {}}
    assert api.post("/api/v1/runs?token=query-secret", body).status == 201
    wrong = api.post("/api/v1/runs", body, headers={"Authorization": "Bearer wrong-secret"})
    assert_json_error(wrong, 403)
    assert_json_error(without_token(api, "GET", "/api/v1/dead"), 401)
    forged = "/api/v1/runs/%0A2030-01-01 INFO api: forged%1b[31m"
    assert_json_error(without_token(api, "GET", forged.replace(" ", "%20")), 401)
    assert api.get("/api/v1/overview").status == 200  # a read that succeeds: not logged
    expected = [
        "POST /api/v1/runs 201 from 127.0.0.1",
        "POST /api/v1/runs 403 from 127.0.0.1",
        "GET /api/v1/dead 401 from 127.0.0.1",
        "GET /api/v1/runs/\\n2030-01-01 INFO api: forged\\x1b[31m 401 from 127.0.0.1",
    ]
    log = api.process.log
    wait_for(
        lambda: all(line in log() for line in expected),
        timeout=10,
        interval=0.1,
        what=f"the access log lines {expected}",
    )
    text = log()
    assert count_runs(sql) == 1
    for secret in (TOKEN, "wrong-secret", "query-secret", "Bearer", "\x1b"):
        assert secret not in text, secret
    assert "/api/v1/overview" not in text
    assert not [line for line in text.splitlines() if line.startswith("2030-01-01")]
