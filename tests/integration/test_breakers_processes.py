"""Circuit breakers and pauses with a real tree (issue 20, SPEC 7.4): ``flowforge up`` with 4
workers, a handler whose "dependency" (a file flag) the test takes down and brings back, and every
call counted in the database (test_executions: what each call found).

The breaker must open after ``failures`` failures, hold (no call but one probe per cooldown), and
close on the first probe after the dependency is back; every task then SUCCEEDS. The calls made
while the dependency was down are exactly those claimed before the breaker opened (the failures
that opened it and the calls already in flight: claimed, not yet run) plus one per probe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from flowforge.store.breakers import Gates
from flowforge.store.db import Database
from tests.e2e import Stack
from tests.helpers import query_count, wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real tree

Sql = psycopg.Connection[tuple[Any, ...]]

FAILURES = 3
COOLDOWN_S = 1
RUNS = 40
DONE_S = 120.0
WORKFLOW = workflow_from_mapping(
    {
        "name": "partner",
        "tasks": [
            {
                "name": "call",
                "handler": "e2e.dependency",
                "retry": {"max_attempts": 50, "base_delay": 0.2, "max_delay": 0.5},
                "circuit_breaker": {"failures": FAILURES, "window": "60s", "cooldown": "1s"},
            }
        ],
    }
)
PLAIN = workflow_from_mapping(
    {"name": "plain", "tasks": [{"name": "one", "handler": "e2e.record"}]}
)


def transitions(sql: Sql, cause: str) -> int:
    return query_count(sql, "SELECT count(*) FROM breaker_transitions WHERE cause = %s", cause)


def all_succeeded(sql: Sql, tree: Tree, runs: list[UUID]) -> bool:
    assert tree.proc.poll() is None, f"the tree exited:\n{tree.log()[-3000:]}"
    done = "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s) AND state = 'SUCCEEDED'"
    return query_count(sql, done, runs) == len(runs)


def test_the_breaker_opens_holds_probes_and_closes_and_every_task_succeeds(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    down = tmp_path / "dependency-down"
    config = stack.config_path(processes={"workers": 4})
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    down.touch()  # the dependency is down from the start
    with Client(load_config(config, env={}), [WORKFLOW]) as client:
        runs = [r.run_id for r in client.trigger_many("partner", [{"down": str(down)}] * RUNS)]
    wait_for(lambda: transitions(sql, "failures") == 1, 60.0, 0.05, "the breaker to open")
    # it holds: every task not yet called waits parked, and a probe per cooldown fails
    wait_for(lambda: transitions(sql, "probe_failed") >= 3, 60.0, 0.05, "three failed probes")
    parked = query_count(sql, "SELECT count(*) FROM task_runs WHERE parked_on = 'circuit_open'")
    assert parked >= RUNS - 3 * 4 - 3  # most tasks never called the dependency while it is down
    down.unlink()  # the dependency is back: the next probe succeeds and closes the breaker
    wait_for(lambda: all_succeeded(sql, trees[0], runs), DONE_S, 0.2, "every run to succeed")
    assert transitions(sql, "probe_succeeded") == 1
    down_calls = query_count(
        sql, "SELECT count(*) FROM test_executions WHERE handler = 'e2e.dependency:down'"
    )
    # a probe's call: the attempt after the one it had when chosen (breaker_transitions)
    probe_calls = query_count(
        sql,
        "SELECT count(*) FROM test_executions x JOIN breaker_transitions p"
        "  ON p.probe_task_id = x.task_run_id AND x.attempt = p.probe_attempt + 1"
        " WHERE x.handler = 'e2e.dependency:down'",
    )
    # the others: the failures that opened it, and the calls already in flight (claimed before
    # the opening committed: a worker's batch claimed together, or a claim racing the commit)
    others = sql.execute(
        "SELECT a.started_at FROM test_executions x JOIN task_attempts a"
        "  ON a.task_run_id = x.task_run_id AND a.attempt = x.attempt"
        " WHERE x.handler = 'e2e.dependency:down' AND NOT EXISTS ("
        "   SELECT 1 FROM breaker_transitions p"
        "    WHERE p.probe_task_id = x.task_run_id AND x.attempt = p.probe_attempt + 1)"
    ).fetchall()
    first_probe = sql.execute(
        "SELECT min(at) FROM breaker_transitions WHERE cause = 'cooldown'"
    ).fetchone()
    assert first_probe is not None
    in_flight = len(others) - FAILURES
    probes = transitions(sql, "cooldown")
    print(
        f"calls while down: {down_calls} = {FAILURES} failures that opened it + {in_flight} "
        f"in flight when it opened + {probe_calls} probes ({probes} probes, "
        f"{transitions(sql, 'probe_failed')} failed, {transitions(sql, 'probe_lost')} lost)"
    )
    assert down_calls == FAILURES + in_flight + probe_calls
    assert probe_calls == transitions(sql, "probe_failed")  # each failed probe: one call
    assert 0 <= in_flight <= 4 * 10  # 4 workers, each with at most a batch claimed
    # once the opening was visible no call but a probe's was made: every other call was
    # claimed before the first probe was even chosen
    assert all(started < first_probe[0] for (started,) in others)
    # each transition (a database row) is logged once, by the tree's scheduler
    rows = sql.execute(
        "SELECT from_state, to_state, cause FROM breaker_transitions ORDER BY id"
    ).fetchall()

    def logged() -> bool:
        log = trees[0].log()
        return all(
            log.count(f"circuit breaker of handler 'e2e.dependency': {a} -> {b} ({c})")
            == rows.count((a, b, c))
            for a, b, c in rows
        )

    wait_for(logged, 30.0, 0.1, "one log line per transition")
    # no parked task used an attempt: every second attempt is a failed call's retry
    calls = query_count(sql, "SELECT count(*) FROM test_executions")
    attempts = query_count(sql, "SELECT count(*) FROM task_attempts")
    assert calls == attempts  # every attempt called the dependency once, none was parked
    assert query_count(sql, "SELECT count(*) FROM task_runs WHERE parked_on IS NOT NULL") == 0


def test_pausing_a_queue_stops_its_claims_until_resumed_and_loses_nothing(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 2})
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    db = Database(load_config(config, env={}).database)
    db.open()
    try:
        gates = Gates(db)
        with Client(load_config(config, env={}), [PLAIN]) as client:
            first = [r.run_id for r in client.trigger_many("plain", [{}] * 5)]
            wait_for(lambda: all_succeeded(sql, trees[0], first), DONE_S, 0.1, "the first runs")
            gates.pause("queue", stack.queue, "test", "deploying")
            runs = [r.run_id for r in client.trigger_many("plain", [{}] * 20)]
        # every task was dispatched and claimed, and parked at its claim, none executed
        parked = "SELECT count(*) FROM task_runs WHERE parked_on = 'paused' AND run_id = ANY(%s)"
        wait_for(lambda: query_count(sql, parked, runs) == 20, 60.0, 0.05, "20 parked tasks")
        executed = "SELECT count(*) FROM test_executions WHERE run_id = ANY(%s)"
        assert query_count(sql, executed, runs) == 0
        gates.resume("queue", stack.queue, "test", None)
        wait_for(lambda: all_succeeded(sql, trees[0], runs), DONE_S, 0.1, "the paused runs")
        assert query_count(sql, executed, runs) == 20  # each once: nothing lost, nothing doubled
        assert query_count(sql, "SELECT count(*) FROM task_attempts WHERE attempt > 1") == 0
    finally:
        db.close()


KEYED = workflow_from_mapping(
    {
        "name": "partner_keyed",
        "tasks": [
            {
                "name": "call",
                "handler": "e2e.dependency",
                "retry": {"max_attempts": 50, "base_delay": 0.2, "max_delay": 0.5},
                "circuit_breaker": {
                    "failures": FAILURES,
                    "window": "60s",
                    "cooldown": "1s",
                    "key": "partner-{region}",
                },
            }
        ],
    }
)
RUNS_PER_KEY = 20


def test_one_keys_breaker_holds_its_tasks_while_the_other_keys_run_and_succeed(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    eu_down, us_down = tmp_path / "eu-down", tmp_path / "us-down"  # us's is never down
    config = stack.config_path(processes={"workers": 4})
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    eu_down.touch()
    opened = "SELECT count(*) FROM breaker_transitions WHERE key = %s AND cause = 'failures'"
    with Client(load_config(config, env={}), [KEYED]) as client:
        eu_input = {"region": "eu", "down": str(eu_down)}
        eu = [r.run_id for r in client.trigger_many("partner_keyed", [eu_input] * RUNS_PER_KEY)]
        wait_for(lambda: query_count(sql, opened, "partner-eu") == 1, 60.0, 0.05, "eu's breaker")
        us_input = {"region": "us", "down": str(us_down)}
        us = [r.run_id for r in client.trigger_many("partner_keyed", [us_input] * RUNS_PER_KEY)]
    # us's tasks run and succeed while eu's breaker holds eu's (eu's dependency is still down)
    wait_for(lambda: all_succeeded(sql, trees[0], us), DONE_S, 0.1, "every us run")
    states = dict(
        sql.execute("SELECT key, state FROM breakers WHERE handler = 'e2e.dependency'").fetchall()
    )
    assert states == {"partner-eu": states["partner-eu"]} and states["partner-eu"] != "closed"
    executed = "SELECT count(*) FROM test_executions WHERE run_id = ANY(%s)"
    assert query_count(sql, executed, us) == RUNS_PER_KEY  # each once: none held, none failed
    down_calls = "SELECT count(*) FROM test_executions WHERE handler = 'e2e.dependency:down'"
    held_back = query_count(sql, down_calls)
    # most of eu's tasks never called its dependency: the failures that opened the breaker,
    # the calls in flight then (4 workers, each with at most a batch claimed) and the probes
    probes = query_count(sql, "SELECT count(*) FROM breaker_transitions WHERE cause = 'cooldown'")
    print(
        f"keyed: {RUNS_PER_KEY} us runs succeeded (one call each) while eu's breaker held; "
        f"eu's calls while down: {held_back} of {RUNS_PER_KEY} tasks ({probes} probes)"
    )
    assert held_back <= FAILURES + 4 * 10 + probes
    eu_down.unlink()  # eu's dependency is back: its next probe closes its breaker
    wait_for(lambda: all_succeeded(sql, trees[0], eu), DONE_S, 0.2, "every eu run")
    closed = "SELECT count(*) FROM breaker_transitions WHERE key = %s AND cause = %s"
    assert query_count(sql, closed, "partner-eu", "probe_succeeded") == 1
    assert (
        query_count(sql, "SELECT count(*) FROM breaker_transitions WHERE key <> 'partner-eu'") == 0
    )
    assert query_count(sql, "SELECT count(*) FROM task_runs WHERE parked_on IS NOT NULL") == 0
    line = "circuit breaker of handler 'e2e.dependency' key 'partner-eu': closed -> open (failures)"
    wait_for(lambda: trees[0].log().count(line) == 1, 30.0, 0.1, "the opening logged once")
