"""``POST /api/v1/runs`` answers with the run as ``GET /api/v1/runs/{id}`` reads it right after.

The POST builds its answer from what the trigger wrote (store/triggers.py ``Written``) instead
of reading the run back; a replayed ``Idempotency-Key`` still reads it. Against a real api
child (nothing else running, so nothing moves the run between the two requests), the POST's
body is the GET's, byte for byte: the same fields, in the same order, with the same values —
for a two-task run with an edge, a one-task run, a keyed run created and replayed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.api_client import Api, module_api

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    with module_api(tmp_path_factory.mktemp("api-answer"), database_url, broker_url) as found:
        yield found


@pytest.mark.parametrize(
    "body",
    [
        {"workflow": "api-other", "input": {"n": 1, "zz": [1.5, {"b": None, "a": "é"}]}},
        {"workflow": "api-record"},
        {"workflow": "api-record", "input": {"n": 2}, "priority": 7, "delay": "10m"},
    ],
)
def test_a_created_runs_answer_is_its_read_byte_for_byte(api: Api, body: dict[str, object]) -> None:
    created = api.post("/api/v1/runs", body)
    assert created.status == 201, created.body
    read = api.get(created.headers["Location"])
    assert read.status == 200, read.body
    assert created.body == read.body


def test_a_keyed_runs_answer_is_its_read_created_and_replayed(api: Api) -> None:
    body = {"workflow": "api-keyed", "input": {"order_id": 41}}
    key = {"Idempotency-Key": f"answer-{uuid.uuid4().hex}"}
    created = api.post("/api/v1/runs", body, headers=key)
    assert created.status == 201, created.body
    replayed = api.post("/api/v1/runs", body, headers=key)
    assert replayed.status == 200, replayed.body
    read = api.get(created.headers["Location"])
    assert created.body == read.body == replayed.body
