"""``POST /api/v1/runs:batch`` (issue 22) against a real api child (``flowforge role api``).

Proven here: runs of several workflows are created in the items' order with each item's own
input, timing and priority; each item's idempotency key replays its run (``created`` false,
200 when every item replayed) and a key used for another body is a 409 naming the item, with
nothing created; a bad item refuses the whole batch with a 4xx naming its place (``runs[N]``)
and nothing is created; the limits (an empty batch, more than 1,000 items, a body of another
shape, an ``Idempotency-Key`` header) are 4xx naming what is wrong; the batch is a mutation
(the bearer token is needed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.api_client import Api, assert_json_error, count_runs, module_api

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
BATCH = "/api/v1/runs:batch"


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    with module_api(tmp_path_factory.mktemp("api-batch"), database_url, broker_url) as found:
        yield found


def test_a_batch_creates_runs_of_several_workflows_in_the_items_order(api: Api, sql: Sql) -> None:
    items = [
        {"workflow": "api-record", "input": {"n": 0}},
        {"workflow": "api-other", "input": {"n": 1}, "priority": 9},
        {"workflow": "api-record", "input": {"n": 2}, "delay": "10m"},
        {"workflow": "api-record"},
    ]
    reply = api.post(BATCH, {"runs": items})
    assert reply.status == 201, reply.body
    answered = reply.json()["runs"]
    assert [r["created"] for r in answered] == [True] * 4
    assert len({r["id"] for r in answered}) == 4
    runs = [api.get(f"/api/v1/runs/{r['id']}").json() for r in answered]
    assert [r["workflow"] for r in runs] == ["api-record", "api-other", "api-record", "api-record"]
    assert [r["input"] for r in runs] == [{"n": 0}, {"n": 1}, {"n": 2}, {}]
    assert [r["state"] for r in runs] == ["PENDING", "PENDING", "SCHEDULED", "PENDING"]
    assert {t["priority"] for t in runs[1]["tasks"]} == {9}
    assert count_runs(sql) == 4


def test_each_items_key_replays_its_run_and_a_key_with_another_body_refuses_the_batch(
    api: Api, sql: Sql
) -> None:
    items = [
        {"workflow": "api-record", "input": {"n": 1}, "idempotency_key": "k-1"},
        {"workflow": "api-other", "input": {"n": 2}, "idempotency_key": "k-2"},
        {"workflow": "api-record", "input": {"n": 1}, "idempotency_key": "k-1"},  # the same
    ]
    first = api.post(BATCH, {"runs": items})
    assert first.status == 201, first.body
    ids = [r["id"] for r in first.json()["runs"]]
    assert ids[0] == ids[2] and [r["created"] for r in first.json()["runs"]] == [True, True, False]
    replay = api.post(BATCH, {"runs": items})
    assert replay.status == 200, replay.body
    assert [(r["id"], r["created"]) for r in replay.json()["runs"]] == [(i, False) for i in ids]
    other = [{"workflow": "api-record", "input": {}}, {**items[1], "input": {"n": 3}}]
    message = assert_json_error(api.post(BATCH, {"runs": other}), 409)
    assert message.startswith("runs[1]: ") and "'k-2'" in message
    assert count_runs(sql) == 2  # the batch that conflicted created nothing


@pytest.mark.parametrize(
    ("item", "status", "words"),
    [
        ({"workflow": "api-record", "input": [1]}, 400, "'input' must be a JSON object"),
        ({"workflow": "api-record", "bogus": 1}, 400, "unknown field 'bogus'"),
        ({"workflow": ""}, 400, "'workflow' must be a non-empty string"),
        ({"workflow": "nope"}, 422, "unknown workflow 'nope'"),
        ({"workflow": "api-record", "priority": 10}, 400, "priority"),
        ({"workflow": "api-record", "delay": "soon"}, 400, "'delay'"),
        ({"workflow": "api-record", "idempotency_key": "k" * 256}, 400, "'idempotency_key'"),
        ({"workflow": "api-record", "idempotency_key": 7}, 400, "'idempotency_key'"),
        ({"workflow": "api-record", "input": {"s": "a\u0000b"}}, 400, "NUL"),
        ([1], 400, "an item must be a JSON object"),
    ],
    ids=lambda value: str(value)[:30],
)
def test_a_bad_item_refuses_the_whole_batch_naming_its_place(
    api: Api, sql: Sql, item: Any, status: int, words: str
) -> None:
    items = [{"workflow": "api-record", "input": {"n": 0}}, item]
    message = assert_json_error(api.post(BATCH, {"runs": items}), status)
    assert message.startswith("runs[1]: ") and words in message, message
    assert count_runs(sql) == 0


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"),
    [
        ({"runs": []}, {}, 400, "non-empty array"),
        ({"runs": {"workflow": "api-record"}}, {}, 400, "non-empty array"),
        ({"runs": [{"workflow": "api-record"}] * 1001}, {}, 413, "at most 1000 runs"),
        ({"workflow": "api-record"}, {}, 400, '{"runs": [...]}'),
        ({"runs": [{"workflow": "api-record"}], "more": 1}, {}, 400, '{"runs": [...]}'),
        ({"runs": [{"workflow": "api-record"}]}, {"Idempotency-Key": "k"}, 400, "each item"),
    ],
    ids=["empty", "not-a-list", "too-many", "no-runs", "more-fields", "header-key"],
)
def test_the_batchs_limits_are_4xx_naming_what_is_wrong(
    api: Api, sql: Sql, body: Any, headers: dict[str, str], status: int, words: str
) -> None:
    message = assert_json_error(api.post(BATCH, body, headers=headers), status)
    assert words in message, message
    assert count_runs(sql) == 0


def test_a_batch_of_the_limit_is_created_and_needs_the_token(api: Api, sql: Sql) -> None:
    items = [{"workflow": "api-record", "input": {"n": n}} for n in range(1000)]
    assert_json_error(api.post(BATCH, {"runs": items}, auth=False), 401)
    assert count_runs(sql) == 0
    reply = api.post(BATCH, {"runs": items})
    assert reply.status == 201, reply.body[:300]
    assert len(reply.json()["runs"]) == 1000
    assert count_runs(sql) == 1000
