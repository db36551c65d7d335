"""``scripts/bench``'s api workloads: the HTTP request path of a real ``flowforge up`` tree.

Clients are threads with one keep-alive connection each (``http.client``), as a service calling
the api would hold. Three workloads, each ``requests`` requests spread over ``clients``:

* ``api trigger``: ``POST /api/v1/runs`` of a one-task run (a validated input, a plan, one
  transaction) — what a caller pays to start work;
* ``api read``: ``GET /api/v1/runs/{id}`` of runs that exist (a run with its tasks);
* ``api live``: ``GET /health/live`` — the floor of the request path itself (the Host check,
  the head deadline, the access log, falcon and waitress), with no database call.

Each reports requests per second (wall, all clients) and the latency median and p99 in
milliseconds, measured by the client. Nothing here asserts a figure.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The bearer token the bench's tree is given (a throwaway: the tree lives for one bench run).
TOKEN = "bench-token-not-a-secret"
TOKEN_ENV = "FLOWFORGE_BENCH_API_TOKEN"
TIMEOUT_S = 30.0

Request = Callable[[http.client.HTTPConnection, int], None]


@dataclass(frozen=True)
class ApiFigures:
    requests_per_s: float
    p50_ms: float
    p99_ms: float


def api_settings(port: int) -> dict[str, Any]:
    """The ``api:`` section of the bench tree's config (the token comes from TOKEN_ENV)."""
    return {
        "listen": f"127.0.0.1:{port}",
        "token_env": TOKEN_ENV,
        "max_connections_per_client": 0,  # every bench client comes from 127.0.0.1
    }


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def check(response: http.client.HTTPResponse, expected: int) -> bytes:
    body = response.read()
    if response.status != expected:
        raise RuntimeError(f"api answered {response.status}, not {expected}: {body[:200]!r}")
    return body


def _drive(port: int, requests: int, clients: int, request: Request) -> ApiFigures:
    """Run ``requests`` calls of ``request`` over ``clients`` keep-alive connections."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        try:
            for n in range(index, requests, clients):
                started = time.perf_counter()
                request(conn, n)
                latencies[index].append((time.perf_counter() - started) * 1000)
        except BaseException as exc:  # reported below, after every client ended
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * requests)
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"an api client failed: {errors[0]!r}")
    every = sorted(ms for per_client in latencies for ms in per_client)
    return ApiFigures(
        requests_per_s=len(every) / wall,
        p50_ms=statistics.median(every),
        p99_ms=every[min(len(every) - 1, round(0.99 * (len(every) - 1)))],
    )


def wait_live(port: int, timeout_s: float) -> None:
    """Poll ``/health/live`` until the api answers 200 (raises after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        try:
            conn.request("GET", "/health/live")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the api on port {port} did not answer in {timeout_s} s")
        time.sleep(0.1)


def trigger(port: int, workflow: str, requests: int, clients: int) -> tuple[ApiFigures, list[str]]:
    """``POST /api/v1/runs`` ``requests`` times; the figures and the run ids created."""
    created: list[str] = []
    lock = threading.Lock()

    def post(conn: http.client.HTTPConnection, n: int) -> None:
        body = json.dumps({"workflow": workflow, "input": {"n": n}})
        conn.request("POST", "/api/v1/runs", body=body, headers=_headers())
        run = json.loads(check(conn.getresponse(), 201))
        with lock:
            created.append(run["id"])

    return _drive(port, requests, clients, post), created


def read(port: int, run_ids: list[str], requests: int, clients: int) -> ApiFigures:
    """``GET /api/v1/runs/{id}`` over ``run_ids``, ``requests`` times."""

    def get(conn: http.client.HTTPConnection, n: int) -> None:
        conn.request("GET", f"/api/v1/runs/{run_ids[n % len(run_ids)]}", headers=_headers())
        check(conn.getresponse(), 200)

    return _drive(port, requests, clients, get)


def live(port: int, requests: int, clients: int) -> ApiFigures:
    """``GET /health/live``, ``requests`` times."""

    def get(conn: http.client.HTTPConnection, _n: int) -> None:
        conn.request("GET", "/health/live")
        check(conn.getresponse(), 200)

    return _drive(port, requests, clients, get)
