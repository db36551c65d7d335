"""``Client.trigger`` from many threads at once shares transactions (flowforge/coalesce.py)
against real PostgreSQL, and each call still gets what it would get alone.

Threads released together by a barrier call one shared :class:`Client`. The client's
``trigger_batch`` (what a shared commit runs) is wrapped to count its calls, so a test knows
runs were created together; what each call returns, raises and stores is checked against the
database.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from flowforge import Client
from flowforge.config import DatabaseConfig, load_config
from flowforge.domain.model import TriggerResult
from flowforge.domain.values import MAX_DEPTH, MAX_JSON_BYTES
from flowforge.errors import DatabaseUnavailableError, InputError, TriggerConflictError
from tests.api_client import Sql
from tests.coalescing import at_once, count_commits, unreachable
from tests.helpers import single

pytestmark = pytest.mark.integration

THREADS = 16


@pytest.fixture
def client(clean_database_url: str) -> Iterator[Client]:
    config = dataclasses.replace(
        load_config(env={}), database=DatabaseConfig(url=clean_database_url, pool_max=4)
    )
    with Client(config, [single("together")]) as found:
        yield found


@pytest.fixture
def batches(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every shared commit the client runs (its ``trigger_batch`` calls)."""
    return count_commits(client, monkeypatch).shared


def stored(sql: Sql, tag: str) -> list[int]:
    found = sql.execute(
        "SELECT (input->>'n')::int FROM workflow_runs WHERE input->>'tag' = %s", (tag,)
    ).fetchall()
    return sorted(n for (n,) in found)


def test_threads_triggering_at_once_share_commits_and_each_gets_its_run(
    client: Client, batches: list[int], sql: Sql
) -> None:
    tag = uuid.uuid4().hex
    rounds = 5
    results: list[TriggerResult] = []
    for r in range(rounds):
        numbers = range(r * THREADS, (r + 1) * THREADS)
        calls: list[Callable[[], Any]] = [
            functools.partial(client.trigger, "together", {"tag": tag, "n": n}, with_run=n % 2 == 0)
            for n in numbers
        ]
        results.extend(at_once(calls))
    assert all(isinstance(r, TriggerResult) and r.created for r in results), results
    assert stored(sql, tag) == list(range(rounds * THREADS))
    assert len({r.run_id for r in results}) == rounds * THREADS
    for n, result in enumerate(results):
        if n % 2:
            assert result.run is None  # it did not ask, even when its batch answered runs
        else:
            assert result.run is not None
            assert result.run == client.status(result.run_id)
            assert result.run.input == {"tag": tag, "n": n}
    assert batches and max(batches) > 1  # some commits were shared


def test_a_bad_call_among_threads_fails_alone_and_the_others_are_created(
    client: Client, sql: Sql
) -> None:
    tag = uuid.uuid4().hex
    key = f"taken-{tag}"
    client.trigger("together", {"tag": "first"}, key)
    calls: list[Callable[[], Any]] = [
        functools.partial(client.trigger, "together", {"tag": tag, "n": n}) for n in range(THREADS)
    ]
    calls[4] = functools.partial(client.trigger, "together", {"tag": "other"}, key)
    calls[9] = functools.partial(client.trigger, "together", {"tag": tag}, priority=12)
    outcomes = at_once(calls)
    assert isinstance(outcomes[4], TriggerConflictError)
    assert isinstance(outcomes[9], InputError)
    good = [o for i, o in enumerate(outcomes) if i not in (4, 9)]
    assert all(isinstance(o, TriggerResult) and o.created for o in good), good
    assert stored(sql, tag) == sorted(n for n in range(THREADS) if n not in (4, 9))


def nested(depth: int) -> list[Any]:
    """A list ``depth`` lists deep."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


#: Inputs that no run may store, refused by the client's checks (values.py) or by PostgreSQL:
#: JSON has no NaN, jsonb no NUL and no lone surrogate, and nesting and size past the limits.
UNSTORABLE: list[dict[str, Any]] = [
    {"x": float("nan")},
    {"x": "a\x00b"},
    {"x": "\ud800"},
    {"x": nested(MAX_DEPTH + 1)},
    {"x": "a" * MAX_JSON_BYTES},
]


def test_unstorable_inputs_among_threads_fail_alone_as_they_do_alone(
    client: Client, batches: list[int], sql: Sql
) -> None:
    """Every member of the family, each in a burst of good calls: the error it gets is the one
    it gets alone (type and text), and the good calls are created."""
    alone = []
    for bad in UNSTORABLE:
        with pytest.raises(InputError) as raised:
            client.trigger("together", bad)
        alone.append((type(raised.value), str(raised.value)))
    tag = uuid.uuid4().hex
    places = (1, 4, 7, 10, 13)
    calls: list[Callable[[], Any]] = [
        functools.partial(client.trigger, "together", {"tag": tag, "n": n})
        for n in range(THREADS - len(UNSTORABLE))
    ]
    for place, bad in zip(places, UNSTORABLE, strict=True):
        calls.insert(place, functools.partial(client.trigger, "together", bad))
    outcomes = at_once(calls)
    got = [(type(outcomes[p]), str(outcomes[p])) for p in places]
    assert got == alone
    good = [o for i, o in enumerate(outcomes) if i not in places]
    assert all(isinstance(o, TriggerResult) and o.created for o in good), good
    assert stored(sql, tag) == list(range(THREADS - len(UNSTORABLE)))


def test_an_outage_fails_every_call_of_a_shared_commit_without_trying_each_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database nobody listens on (refused at once): every call raises
    DatabaseUnavailableError, and the calls that shared a commit were not tried one by one."""
    with Client(unreachable(), [single("together")]) as client:
        commits = count_commits(client, monkeypatch)
        outcomes = at_once(
            [functools.partial(client.trigger, "together", {"n": n}) for n in range(THREADS)]
        )
    alone, shared = commits.alone, commits.shared
    assert all(isinstance(o, DatabaseUnavailableError) for o in outcomes), outcomes
    assert shared and max(shared) > 1
    assert len(alone) + sum(shared) == THREADS  # each call tried once: alone or shared
