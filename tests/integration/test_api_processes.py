"""``api.processes: 2`` on a real tree (issue 22; failure mode 100): both api children serve the
one port, and one of them SIGKILLed leaves the api answering while the supervisor restarts it.

Triggers run the whole time from a few client threads, each request on a fresh connection with
an idempotency key of its own; a request cut by the kill (its connection reset, its answer
lost) is sent again with the same key, as a client should. Counted in PostgreSQL afterwards:
one run per key — nothing lost, nothing made twice. Which child served which request is read
from the access log (``api-N[PID] flowforge.api.access: POST ...``). Every wait polls with a
deadline.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.api_client import TOKEN, TOKEN_ENV, Api, api_settings
from tests.e2e import Stack
from tests.harness.api_children import api_pids
from tests.harness.resources import free_ports
from tests.helpers import wait_for
from tests.trees import Tree, alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real tree

Sql = psycopg.Connection[tuple[Any, ...]]
WORKFLOW = "api-record"
CLIENTS = 3
PACE_S = 0.02  # between one client's requests: steady load, not a flood of 2 cores
RETRIES = 20  # sends of one key at most (a reset connection is sent again)
WAIT_S = 60.0
SERVED = re.compile(r" (api-\d+)\[(\d+)\] flowforge\.api\.access: POST /api/v1/runs 201 ")


class Load:
    """``CLIENTS`` threads triggering runs, each request with its own idempotency key, sent
    again with that key while its connection fails; until :meth:`stop`."""

    def __init__(self, api: Api) -> None:
        self.answered: dict[str, str] = {}  # key -> run id
        self.resent: list[str] = []  # keys sent again after a connection error
        self.problems: list[str] = []  # a status other than 201, or a key never answered
        self._api = api
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(CLIENTS)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, client: int) -> None:
        sent = 0
        while not self._stop.is_set():
            key = f"c{client}-{sent}"
            sent += 1
            self._one(key)
            self._stop.wait(PACE_S)

    def _one(self, key: str) -> None:
        for _ in range(RETRIES):
            try:
                reply = self._api.post(
                    "/api/v1/runs",
                    {"workflow": WORKFLOW, "input": {"key": key}},
                    headers={"Idempotency-Key": key},
                    timeout=30,
                )
            # reset or refused, or an answer cut short (IncompleteRead is no OSError): the child
            # that held the connection was killed; the key makes the resend safe
            except (OSError, http.client.HTTPException):
                with self._lock:
                    self.resent.append(key)
                continue
            with self._lock:
                if reply.status == 201 or reply.status == 200:
                    self.answered[key] = str(reply.json()["id"])
                else:
                    self.problems.append(f"{key}: {reply.status} {reply.body[:200]!r}")
            return
        with self._lock:
            self.problems.append(f"{key}: no answer in {RETRIES} sends")

    def count(self) -> int:
        with self._lock:
            return len(self.answered)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(RETRIES * 35)
            assert not thread.is_alive(), "a client thread did not stop"


def served_by(log: str) -> dict[str, set[int]]:
    """The pids that answered a POST with 201, by child label, from the tree's log."""
    found: dict[str, set[int]] = {}
    for label, pid in SERVED.findall(log):
        found.setdefault(label, set()).add(int(pid))
    return found


def test_two_api_children_serve_one_port_and_one_killed_is_restarted_losing_nothing(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    port = free_ports(1)[0]
    config = stack.config_path(
        processes={"workers": 1},
        **api_settings(tmp_path, port, processes=2, max_connections_per_client=0),
    )
    tree = Tree(config, tmp_path / "tree.log", env={**stack.env(), TOKEN_ENV: TOKEN})
    trees.append(tree)
    tree.ready()
    first = sorted(api_pids(tree.supervisor()))
    assert len(first) == 2, tree.log()[-3000:]
    api = Api(port, TOKEN, config)

    load = Load(api)
    try:
        # both children take connections from the one socket
        wait_for(
            lambda: set().union(*served_by(tree.log()).values()) >= set(first),
            WAIT_S,
            0.1,
            "a POST answered by each api child",
        )
        assert set(served_by(tree.log())) == {"api-1", "api-2"}
        killed = first[1]
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not alive(killed), WAIT_S, 0.05, "the api child to die")
        survivor = first[0]
        # the api answers while the killed child is restarted (its backoff is 0.5 s at least)
        before = load.count()
        wait_for(lambda: load.count() >= before + 5, WAIT_S, 0.05, "answers after the kill")
        restarted = wait_for(
            lambda: [p for p in api_pids(tree.supervisor()) if p not in first],
            WAIT_S,
            0.1,
            "the killed api child's successor",
        )
        assert time.monotonic() - killed_at < WAIT_S
        assert alive(survivor), "the other api child must keep serving"
        wait_for(
            lambda: restarted[0] in set().union(*served_by(tree.log()).values()),
            WAIT_S,
            0.1,
            "a POST answered by the restarted child",
        )
    finally:
        load.stop()
    log = tree.log()
    assert "killed by SIGKILL" in log and "draining" not in log, log[-3000:]
    assert not load.problems, load.problems[:5]
    assert load.count() >= 20, "the api was not under load"

    ids = {run_id for (run_id,) in sql.execute("SELECT id::text FROM workflow_runs")}
    keys = sql.execute("SELECT idempotency_key, count(*) FROM workflow_runs GROUP BY 1").fetchall()
    assert {key for key, _ in keys} == set(load.answered)  # nothing lost, nothing unasked
    assert {n for _, n in keys} == {1}  # nothing made twice, resent keys included
    assert ids == set(load.answered.values())
