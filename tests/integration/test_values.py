"""Values PostgreSQL cannot store, pushed through the real paths into it (SPEC 7.1).

Generated JSON-ish values (NaN, ±Infinity, NUL, lone surrogates in strings and keys, deep
nesting, big strings, non-JSON types; tests/values.py) go through the real trigger path
(:class:`Client` → the store's ``Triggers`` → PostgreSQL), the real finish path (claim, then
classify and finish a batch in one statement), the api's server (``POST /api/v1/runs``, served
from this process) and the CLI. Each is either stored and read back equal, or refused as the
caller's mistake (an :class:`InputError`, HTTP 400, exit 2) with nothing written; never a
database error, never a 5xx; and a bad value never disturbs the other tasks of its batch. The
oracle is independent of the code under test.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowforge.client import Client
from flowforge.config import Config, DatabaseConfig, WorkerConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Finish
from flowforge.domain.policy import RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import MAX_KEY_BYTES, JsonText, check_text
from flowforge.errors import DefinitionError, InputError, PermanentError, UnstorableValueError
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import Job, classify
from flowforge.roles.worker import Worker
from tests.api_client import Api, assert_json_error, serve_here
from tests.e2e import REPO, Stack
from tests.helpers import claim_task, drain, task_ids
from tests.integration.test_cli_operations import assert_operator_error, flowforge
from tests.store import Store
from tests.stubs import Outcomes
from tests.values import (
    canonical,
    cleaned,
    json_values,
    non_json,
    same,
    size,
    storable,
    text_ok,
    texts,
)

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ONCE = RetryPolicy(max_attempts=1)
#: A task key rendered from the input, so keys meet generated text too.
KEYED = WorkflowDef(
    "values-keyed",
    (TaskDef("only", "tests.noop", idempotency_key="k-{k}", ordering_key="o-{k}", retry=ONCE),),
)
PLAIN = WorkflowDef("values-plain", (TaskDef("only", "tests.noop", retry=ONCE),))
#: Results over this many bytes end result_too_large in the finish tests.
MAX_RESULT = 2048
#: Tasks finished in one statement beside the generated one.
NEIGHBOURS = 3
PROPERTY = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def count(sql: Sql, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def key_text(value: Any) -> str:
    """What the template ``{k}`` renders a value to."""
    return f"{value}"


def key_ok(key: str) -> bool:
    """The oracle for a key: text PostgreSQL can hold, small enough for an index."""
    return text_ok(key) and len(key.encode()) <= MAX_KEY_BYTES


def expected_refused(run_input: dict[str, Any], task_key: str, key: str | None = None) -> bool:
    """The oracle for one trigger: an unstorable input, or a key text cannot hold (the task
    key rendered from the input, or the trigger's own idempotency key)."""
    return not (storable(run_input) and key_ok(task_key) and (key is None or key_ok(key)))


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    """The api role, served from this process (tests/api_here.py) for this module."""
    stack = Stack(tmp_path_factory.mktemp("values-api"), database_url, broker_url)
    found, server = serve_here(stack)
    try:
        yield found
    finally:
        server.stop()
        stack.delete_queue()


@pytest.fixture
def client(clean_database_url: str) -> Iterator[Client]:
    config = Config(database=DatabaseConfig(url=clean_database_url))
    with Client(config, workflows=[KEYED, PLAIN]) as opened:
        yield opened


# ------------------------------------------------------------------ the trigger path


@PROPERTY
@given(
    st.lists(
        st.fixed_dictionaries({"k": st.one_of(texts, json_values), "v": json_values}),
        min_size=1,
        max_size=3,
    ),
    st.one_of(st.none(), texts),
)
def test_trigger_stores_a_generated_input_as_given_or_refuses_it_as_input_error(
    client: Client, sql: Sql, inputs: list[dict[str, Any]], key: str | None
) -> None:
    # unique per example: the database is not emptied between examples
    keys = [None if key is None else f"{uuid4().hex}-{n}-{key}" for n in range(len(inputs))]
    refused = any(
        expected_refused(i, f"k-{key_text(i['k'])}", k) for i, k in zip(inputs, keys, strict=True)
    )
    before = count(sql, "workflow_runs")
    try:
        results = client.trigger_many("values-keyed", inputs, keys)
    except InputError as exc:  # UnstorableValueError is one: exit 2, HTTP 400
        assert refused, f"refused a storable input: {exc}"
        assert count(sql, "workflow_runs") == before  # one bad input fails the whole batch
        return
    assert not refused, f"stored an unstorable input: {inputs!r}"
    for run_input, result in zip(inputs, results, strict=True):
        assert result.created
        row = sql.execute(
            "SELECT r.input, t.idempotency_key, t.ordering_key FROM workflow_runs r"
            " JOIN task_runs t ON t.run_id = r.id WHERE r.id = %s",
            (result.run_id,),
        ).fetchone()
        assert row is not None
        rendered = key_text(run_input["k"])
        assert same(row[0], canonical(run_input)), (row[0], run_input)
        assert row[1:] == (f"k-{rendered}", f"o-{rendered}")


def test_a_trigger_refusal_names_the_place_and_writes_nothing(client: Client, sql: Sql) -> None:
    cases = [
        ({"k": 1, "items": [0, 0, 0, {"name": "a\x00"}]}, None, "$.items[3].name: NUL"),
        ({"k": 1, "v": {"\ud800": 1}}, None, 'key "\\ud800": lone surrogate'),
        ({"k": 1, "v": math.inf}, None, "$.v: inf is not a JSON number"),
        ({"k": "x" * 2000}, None, "over the limit of 1024 bytes"),
        ({"k": 1}, "trigger\x00key", "the idempotency key: NUL character"),
    ]
    for run_input, key, fragment in cases:
        with pytest.raises(UnstorableValueError) as refused:
            client.trigger("values-keyed", run_input, key)
        assert fragment in str(refused.value)
    assert count(sql, "workflow_runs") == 0 and count(sql, "task_runs") == 0
    # a key template's own text reaches every key: checked when the workflow is defined
    with pytest.raises(DefinitionError, match="idempotency_key: NUL character"):
        TaskDef("only", "tests.noop", idempotency_key="a\x00{k}")


# ------------------------------------------------------------------ the finish path


def finished_job(outcome: Any, raised: bool) -> Job:
    ctx = TaskContext({}, {}, 1, UUID(int=0), UUID(int=0), "only")
    job = Job(lambda _ctx: None, ctx)
    if raised:
        text = outcome if isinstance(outcome, str) else repr(outcome)
        try:
            raise PermanentError(text)
        except PermanentError as exc:
            job.error = exc
            job.traceback = f"Traceback (most recent call last):\n  {text}\nPermanentError"
    else:
        job.result = outcome
    return job


def last_error(sql: Sql, task_id: UUID) -> str:
    row = sql.execute("SELECT last_error FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row[0])


@PROPERTY
@given(st.one_of(json_values, non_json, texts), st.booleans(), st.integers(0, NEIGHBOURS))
def test_finish_stores_a_generated_result_or_buries_it_and_its_batch_finishes_normally(
    repo: Store, sql: Sql, outcome: Any, raised: bool, position: int
) -> None:
    runs = repo.trigger_many(PLAIN, [{"n": n} for n in range(NEIGHBOURS + 1)])
    tasks = [task_ids(repo, r.run_id)["only"] for r in runs]
    claims = [claim_task(repo, sql, t) for t in tasks]
    finishes = [
        Finish(TaskState.SUCCEEDED, result=JsonText(json.dumps({"n": n})))
        for n in range(NEIGHBOURS + 1)
    ]
    finishes[position] = classify(finished_job(outcome, raised), MAX_RESULT)
    batch = [(c.task_run_id, c.fencing_token, f) for c, f in zip(claims, finishes, strict=True)]
    assert repo.finish_many(batch).committed == set(tasks)  # one statement, never refused
    drain(repo)
    got = {
        UUID(str(r[0])): r[1:]
        for r in sql.execute(
            "SELECT id, state, failure_reason, result FROM task_runs WHERE id = ANY(%s)", (tasks,)
        )
    }
    for n, task in enumerate(tasks):
        if n != position:
            assert got[task] == ("SUCCEEDED", None, {"n": n})
    state, reason, result = got[tasks[position]]
    if raised:
        text = outcome if isinstance(outcome, str) else repr(outcome)
        assert (state, reason) == ("DEAD", "permanent_error")
        assert last_error(sql, tasks[position]) == cleaned(f"PermanentError: {text}")[:4000]
    elif not storable(outcome):
        assert (state, reason, result) == ("DEAD", "unserializable_result", None)
    elif size(outcome) > MAX_RESULT:
        assert (state, reason, result) == ("DEAD", "result_too_large", None)
    else:
        assert (state, reason) == ("SUCCEEDED", None)
        assert same(result, canonical(outcome)), (result, outcome)


def test_a_batch_finish_postgresql_still_refuses_is_finished_task_by_task(
    repo: Store, sql: Sql, clean_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence in depth: a value that got past the checks (here, text forged as checked JSON)
    fails the batch's one statement; the worker finishes each task alone, so only the culprit
    fails (DEAD ``unserializable_result`` with the database's message), at once, not after its
    lease; the others succeed, and the worker carries on."""
    config = Config(database=DatabaseConfig(url=clean_database_url), worker=WorkerConfig())
    finished = Outcomes()
    # the worker's own pool is never opened: no broker
    worker = Worker(config, store=repo, hooks=[finished])
    runs = repo.trigger_many(PLAIN, [{"n": n} for n in range(4)])
    tasks = [task_ids(repo, r.run_id)["only"] for r in runs]
    claims = [claim_task(repo, sql, t) for t in tasks]
    forged = JsonText('{"v": NaN}')
    outcomes = [
        (c, Finish(TaskState.SUCCEEDED, result=forged if n == 1 else JsonText(str(n))))
        for n, c in enumerate(claims)
    ]
    with caplog.at_level(logging.WARNING):
        worker._ledger.finish(outcomes, then=None)  # what a batch's flush does
    assert finished.count == 4
    states = {
        UUID(str(r[0])): r[1]
        for r in sql.execute("SELECT id, state FROM task_runs WHERE id = ANY(%s)", (tasks,))
    }
    assert states == {t: "FAILED" if t == tasks[1] else "SUCCEEDED" for t in tasks}
    drain(repo)
    dead = repo.get_task(tasks[1])
    assert (dead.state, dead.failure_reason) == (
        TaskState.DEAD,
        FailureReason.UNSERIALIZABLE_RESULT,
    )
    assert "could not be stored" in last_error(sql, tasks[1])
    assert "invalid input syntax for type json" in last_error(sql, tasks[1])
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(tasks[1]) in warned[0].getMessage()


def test_requeue_text_and_list_filters_postgresql_cannot_hold_are_input_errors(
    repo: Store,
) -> None:
    for requested_by, reason in (("ops\x00", None), ("ops", "\ud800"), ("ops", "x" * 20000)):
        with pytest.raises(UnstorableValueError):
            repo.requeue_dead(UUID(int=1), requested_by, reason)
    with pytest.raises(UnstorableValueError, match="the workflow filter: NUL"):
        repo.list_runs(workflow="a\x00")
    assert check_text("fine", "x") == "fine"


# ------------------------------------------------------------------ the api


@settings(max_examples=60, deadline=None)
@given(json_values, st.one_of(st.none(), texts))
def test_post_runs_answers_201_or_400_for_any_generated_input_never_5xx(
    api: Api, value: Any, key: str | None
) -> None:
    run_input = {"order_id": value}
    body = json.dumps({"workflow": "api-keyed", "input": run_input}).encode()
    headers = {}
    plain_key = True
    if key is not None:  # a header is latin-1 text: other characters go as their escapes
        text = key.encode("latin-1", "backslashreplace").decode("latin-1")
        header = f"{uuid4().hex}-" + "".join(
            c if c.isprintable() else repr(c)[1:-1] for c in text
        )  # a control character is refused by http.client itself (the NUL case is below)
        headers["Idempotency-Key"] = header
        # the api bounds this header; beyond ASCII, what the server accepts is its own affair
        plain_key = header.isascii() and len(header) <= 255
    reply = api.post("/api/v1/runs", body, headers=headers)
    # what the server reads: JSON text joins a high and a low surrogate escape into one
    # character, so two lone surrogates in Python can arrive as one valid character
    seen = json.loads(body)["input"]
    if expected_refused(seen, f"order-{key_text(seen['order_id'])}"):
        assert_json_error(reply, 400)
    elif plain_key or reply.status == 201:
        assert reply.status == 201, (reply.status, reply.body[:300])
        assert same(reply.json()["input"], canonical(seen))
    else:
        assert_json_error(reply, 400)


@pytest.mark.parametrize(
    "body",
    [
        b'{"workflow": "api-record", "input": {"x": "\\ud800"}}',
        b'{"workflow": "api-record", "input": {"\\udfff": 1}}',
        b'{"workflow": "api-record", "input": {"x": "a\\u0000"}}',
        b'{"workflow": "api-record", "input": {"x": NaN}}',
        b'{"workflow": "api-record", "input": {"x": -Infinity}}',
        b'{"workflow": "api-record", "input": {"x": ' + b"[" * 150 + b"]" * 150 + b"}}",
        b'{"workflow": "api-keyed", "input": {"order_id": "\\ud83d"}}',
    ],
    ids=["surrogate", "surrogate-key", "nul", "nan", "minus-infinity", "deep", "rendered-key"],
)
def test_post_runs_with_an_unstorable_input_is_400_naming_it_not_503(api: Api, body: bytes) -> None:
    message = assert_json_error(api.post("/api/v1/runs", body), 400)
    assert "input" in message or "idempotency_key" in message, message
    assert "database" not in message and "unavailable" not in message, message


def test_an_idempotency_key_header_with_a_nul_is_400(api: Api) -> None:
    body = {"workflow": "api-record", "input": {}}
    reply = api.post("/api/v1/runs", body, headers={"Idempotency-Key": "a\x00b"})
    message = assert_json_error(reply, 400)  # the server's own check, before the api's
    assert "database" not in message and "unavailable" not in message, message


# ------------------------------------------------------------------ the cli


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--input", '{"x": "\\ud800"}'), "$.x: lone surrogate U+D800"),
        (("--input", '{"\\udfff": 1}'), 'key "\\udfff"'),
        (("--input", '{"x": ' + "[" * 150 + "]" * 150 + "}"), "nested deeper than 100"),
        (("--input", "{}", "--idempotency-key", "k\udcff"), "idempotency key: lone surrogate"),
    ],
    ids=["surrogate", "surrogate-key", "deep", "key-not-utf8"],
)
def test_cli_trigger_with_an_unstorable_input_or_key_exits_2_with_one_line(
    clean_database_url: str, sql: Sql, args: tuple[str, ...], fragment: str
) -> None:
    example = REPO / "config" / "flowforge.example.yaml"
    result = flowforge("trigger", "hello", *args, url=clean_database_url, config=example)
    assert_operator_error(result, 2, fragment)
    assert count(sql, "workflow_runs") == 0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("runs", "--workflow", "w\udcff"), "the workflow filter: lone surrogate U+DCFF"),
        (
            ("dead", "requeue", str(UUID(int=1)), "--reason", "r\udcfe"),
            "the requeue reason: lone surrogate U+DCFE",
        ),
        (("dead", "requeue", str(UUID(int=1)), "--by", "\udcff"), "requested_by: lone surrogate"),
    ],
    ids=["runs-filter", "requeue-reason", "requeue-by"],
)
def test_cli_text_that_is_not_utf8_is_refused_with_exit_2_not_a_database_error(
    clean_database_url: str, args: tuple[str, ...], fragment: str
) -> None:
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates (surrogateescape)."""
    example = REPO / "config" / "flowforge.example.yaml"
    result = flowforge(*args, url=clean_database_url, config=example)
    assert_operator_error(result, 2, fragment)
