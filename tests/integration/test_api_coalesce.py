"""Concurrent ``POST /api/v1/runs`` requests share transactions (flowforge/coalesce.py) and
each still gets the answer it would get alone, against a real api child and PostgreSQL.

Bursts of requests released together from many threads (the api's 16 request threads commit
what arrives during a commit in one transaction): plain runs, keyed runs sent twice at once,
a key sent with two different inputs at once, and requests that fail — a start time in the
past (refused inside the transaction, by the database's clock), an unknown workflow, a priority
out of range. Each request's status and body are checked, every created run's POST body is its
GET's byte for byte, and the database holds exactly one run per created id and per key.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.api_client import Api, Reply, Sql, assert_json_error, module_api

pytestmark = pytest.mark.integration

#: Requests released together per burst: more than the api's request threads (16), so some
#: wait in waitress's queue; at most api.max_connections_per_client (20), so none is refused.
CLIENTS = 18
WAIT_S = 30.0
#: Where the bad requests go among the good ones of a burst.
BAD_PLACES = (3, 9, 15)
CLOCK_SAYS = re.compile(r"\(the database's clock says [^)]*\)")


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    with module_api(tmp_path_factory.mktemp("api-coalesce"), database_url, broker_url) as found:
        yield found


def runs(tag: str, count: int = CLIENTS) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """``count`` requests of plain one-task runs, numbered in their input, with ``tag``."""
    return [({"workflow": "api-record", "input": {"tag": tag, "n": n}}, {}) for n in range(count)]


def burst(api: Api, requests: list[tuple[dict[str, Any], dict[str, str]]]) -> list[Reply]:
    """``requests`` (body, headers) sent at once, each from its own thread; the replies in
    order."""
    start = threading.Barrier(len(requests))

    def send(body: dict[str, Any], headers: dict[str, str]) -> Reply:
        start.wait(WAIT_S)
        return api.post("/api/v1/runs", body, headers=headers)

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(send, body, headers) for body, headers in requests]
        return [f.result(WAIT_S) for f in futures]


def numbers_stored(sql: Sql, tag: str) -> list[int]:
    """The ``n`` of every run stored with input ``tag``, sorted (a run stored twice shows)."""
    found = sql.execute(
        "SELECT (input->>'n')::int FROM workflow_runs WHERE input->>'tag' = %s AND input ? 'n'",
        (tag,),
    ).fetchall()
    return sorted(n for (n,) in found)


def clockless(message: str) -> str:
    """``message`` without the database's clock it may quote (timing.judge_start_at)."""
    return CLOCK_SAYS.sub("(the database's clock says …)", message)


def test_a_burst_of_runs_each_answered_with_its_own_run(api: Api, sql: Sql) -> None:
    tag = uuid.uuid4().hex
    replies = burst(api, runs(tag))
    ids = []
    for n, reply in enumerate(replies):
        assert reply.status == 201, reply.body
        run = reply.json()
        assert run["input"] == {"tag": tag, "n": n}
        assert reply.headers["Location"] == f"/api/v1/runs/{run['id']}"
        assert api.get(reply.headers["Location"]).body == reply.body
        ids.append(run["id"])
    assert len(set(ids)) == CLIENTS
    assert numbers_stored(sql, tag) == list(range(CLIENTS))


def test_keys_replayed_and_refused_within_a_burst(api: Api, sql: Sql) -> None:
    tag = uuid.uuid4().hex
    same = {"Idempotency-Key": f"same-{tag}"}
    clash = {"Idempotency-Key": f"clash-{tag}"}
    body = {"workflow": "api-keyed", "input": {"order_id": 1, "tag": tag}}
    other = {"workflow": "api-keyed", "input": {"order_id": 2, "tag": tag}}
    replies = burst(api, [(body, same), (body, same), (body, clash), (other, clash), *runs(tag, 8)])

    twins = replies[0:2]
    assert sorted(r.status for r in twins) == [200, 201]
    assert twins[0].json()["id"] == twins[1].json()["id"]
    assert twins[0].body == twins[1].body  # created and replayed answer the same run

    clashing = replies[2:4]
    assert sorted(r.status for r in clashing) == [201, 409]
    refused = next(r for r in clashing if r.status == 409)
    assert "was used for a different request" in assert_json_error(refused, 409)

    assert all(r.status == 201 for r in replies[4:])
    keyed = sql.execute(
        "SELECT idempotency_key, count(*) FROM workflow_runs WHERE idempotency_key = ANY(%s)"
        " GROUP BY idempotency_key",
        ([same["Idempotency-Key"], clash["Idempotency-Key"]],),
    ).fetchall()
    assert dict(keyed) == {
        same["Idempotency-Key"]: 1,
        clash["Idempotency-Key"]: 1,
    }


def test_a_bad_request_in_a_burst_fails_alone_with_its_own_error(api: Api, sql: Sql) -> None:
    tag = uuid.uuid4().hex
    past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    bad: list[tuple[dict[str, Any], int]] = [
        ({"workflow": "api-record", "input": {"tag": tag}, "start_at": past}, 400),
        ({"workflow": "no-such-workflow", "input": {"tag": tag}}, 422),
        ({"workflow": "api-record", "input": {"tag": tag}, "priority": 12}, 400),
    ]
    alone = [assert_json_error(api.post("/api/v1/runs", body), status) for body, status in bad]
    assert "is in the past (the database's clock says" in alone[0]
    requests = runs(tag, CLIENTS - len(bad))
    for place, (body, _status) in zip(BAD_PLACES, bad, strict=True):
        requests.insert(place, (body, {}))
    replies = burst(api, requests)
    for place, (_body, status), message in zip(BAD_PLACES, bad, alone, strict=True):
        # (the past start's error quotes the database's clock, to the second: it may tick
        # between the lone request and the burst)
        assert clockless(assert_json_error(replies[place], status)) == clockless(message)
    created = [r for i, r in enumerate(replies) if i not in BAD_PLACES]
    assert all(r.status == 201 for r in created), [r.body for r in created if r.status != 201]
    assert numbers_stored(sql, tag) == list(range(CLIENTS - len(bad)))
