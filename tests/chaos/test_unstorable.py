"""A real ``flowforge up`` tree running handlers whose values PostgreSQL cannot store (SPEC 7.1).

Handlers return NaN, -Infinity, a NUL, lone surrogates (in a string and in a key), nesting 500
deep and a result over ``worker.max_result_bytes``, or raise an error whose text holds a NUL
and a lone surrogate, mixed into one trigger with normal runs so that they share the workers'
batches (claimed and finished in one statement each). Before SPEC 7.1 one such value failed the
batch's finish: the worker exited, the batch's other tasks ran again, and enough of them
tripped the restart limit. Now every process stays (same pids, no child died), each normal
task executes exactly once (counted in ``test_executions``), and each bad one ends DEAD with
the reason that says why, after one execution.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from tests.chaos.test_supervisor import BATCH_S, Tree, up, write_config
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries allowed, so that a value taken for a transient failure would show as a second run.
RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
MIXED = WorkflowDef("values-mixed", (TaskDef("only", "e2e.unstorable", retry=RETRY),))
#: Each bad kind (tests/e2e_handlers.py) and the reason its task must end DEAD with.
EXPECTED = {
    "nan": "unserializable_result",
    "inf": "unserializable_result",
    "nul": "unserializable_result",
    "surrogate": "unserializable_result",
    "surrogate_key": "unserializable_result",
    "deep": "unserializable_result",
    "big": "result_too_large",
    "nul_error": "permanent_error",
}
#: Normal runs around each bad one, and rounds of all bad kinds.
NORMAL_EACH = 4
ROUNDS = 3
MAX_RESULT_BYTES = 64 * 1024

_ = up  # the fixture, imported for the tests of this module


def final_rows(sql: Sql, run_ids: list[UUID]) -> dict[UUID, tuple[str, str | None, int, str]]:
    """Task run id → (state, failure reason, attempt, last error) for every task of the runs."""
    rows = sql.execute(
        "SELECT t.id, t.state, t.failure_reason, t.attempt, coalesce(t.last_error, '')"
        " FROM task_runs t WHERE t.run_id = ANY(%s)",
        (run_ids,),
    ).fetchall()
    return {UUID(str(r[0])): (str(r[1]), r[2], int(r[3]), str(r[4])) for r in rows}


def test_unstorable_values_beside_normal_runs_keep_every_process_and_run_each_task_once(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(
        write_config(
            stack,
            processes={"workers": 3},
            worker={"max_result_bytes": MAX_RESULT_BYTES},
        )
    )
    tree.wait_ready()
    children = tree.children()
    assert len(tree.pids("worker")) == 3, children

    inputs: list[dict[str, Any]] = []
    for _round in range(ROUNDS):
        for kind in EXPECTED:
            inputs += [{"kind": "ok", "i": len(inputs) + n} for n in range(NORMAL_EACH)]
            inputs.append({"kind": kind})
    run_ids = [r.run_id for r in repo.trigger_many(MIXED, inputs)]  # one burst: shared batches
    kinds = dict(zip(run_ids, (i["kind"] for i in inputs), strict=True))

    def settled() -> bool:
        tree.assert_running()
        states = Counter(state for state, *_ in final_rows(sql, run_ids).values())
        return states["SUCCEEDED"] + states["DEAD"] == len(run_ids)

    wait_for(settled, timeout=BATCH_S, interval=0.1, what=f"{len(run_ids)} tasks to settle")

    by_run = {
        UUID(str(run)): UUID(str(task))
        for run, task in sql.execute(
            "SELECT run_id, id FROM task_runs WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
    }
    rows = final_rows(sql, run_ids)
    executions = Counter(
        UUID(str(t))
        for (t,) in sql.execute(
            "SELECT task_run_id FROM test_executions WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
    )
    wrong: dict[str, Any] = {}
    for run_id, kind in kinds.items():
        task = by_run[run_id]
        state, reason, attempt, error = rows[task]
        expected = ("SUCCEEDED", None) if kind == "ok" else ("DEAD", EXPECTED[kind])
        if (state, reason) != expected or attempt != 1 or executions[task] != 1:
            wrong[f"{kind} {task}"] = (state, reason, attempt, executions[task], error[:120])
    assert not wrong, f"tasks that did not end as expected, executed once: {wrong}"

    # started_at is the claim statement's now(): bad and normal tasks were claimed together,
    # so they were finished together too (one statement per batch)
    claimed = {
        UUID(str(t)): s
        for t, s in sql.execute(
            "SELECT id, started_at FROM task_runs WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
    }
    bad_batches = {claimed[by_run[r]] for r, kind in kinds.items() if kind != "ok"}
    normal_batches = {claimed[by_run[r]] for r, kind in kinds.items() if kind == "ok"}
    assert bad_batches & normal_batches, "no bad task shared a batch with a normal one"

    errors = [rows[by_run[r]][3] for r, kind in kinds.items() if kind == "nul_error"]
    assert errors and all(e == "PermanentError: broken \ufffd text \ufffd here" for e in errors)
    # every process of the tree is the one that was there before: nothing exited or restarted
    assert tree.children() == children, (children, tree.children())
    assert tree.supervisor_events("child_died") == [], tree.supervisor_events("child_died")
    assert tree.running()
