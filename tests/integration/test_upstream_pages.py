"""A claim's bounded upstream (issue 22) against real PostgreSQL: what the ``claim`` query
carries inline past ``worker.upstream_inline_items``, and the pages the handler's views read
(store/upstreams.py). The bound is 3 here so a few rows exercise it; the scale figures are
tests/harness/bench_fanin.py's."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Claim, LargeUpstream
from flowforge.domain.states import TaskState
from flowforge.errors import UpstreamChangedError
from flowforge.roles.upstream import UpstreamList, UpstreamMap, bounded
from flowforge.store.db import Database
from flowforge.store.upstreams import Upstreams
from flowforge.testing import LocalRunner
from tests.helpers import dispatch, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
INLINE = 3


@pytest.fixture
def bounded_repo(db: Database) -> Store:
    store = Store(db, rand=lambda: 0.5)
    store.upstream_inline = INLINE  # Claims' bound (a keyword of its own __init__ only)
    return store


def fan_in(width: int, *extra: TaskDef) -> WorkflowDef:
    tops = tuple(TaskDef(f"t{i}", "tests.noop") for i in range(width))
    names = tuple(t.name for t in (*tops, *extra))
    return WorkflowDef("fan", (*tops, *extra, TaskDef("join", "tests.noop", depends_on=names)))


def run_to_join(repo: Store, sql: Sql, wf: WorkflowDef, results: dict[str, Any]) -> Claim:
    """Trigger ``wf``, finish every task but ``join`` with ``results`` (name → result; a map
    task's items with their index times ten), and claim ``join``."""
    run_id = repo.trigger(wf, {}).run_id
    for _ in range(10):  # a level of the graph per round
        ids = task_ids(repo, run_id)
        sent = dispatch(sql)
        for tid, token in sent:
            claimed = repo.claim(tid, token, "w", 30.0).claim
            assert claimed is not None
            if claimed.task_run_id == ids["join"]:
                return claimed
            result = claimed.item * 10 if claimed.index is not None else results[claimed.name]
            repo.finish(tid, claimed.fencing_token, TaskState.SUCCEEDED, result=result)
        drain(repo)
    raise AssertionError("join never became READY")


def test_a_fan_in_within_the_bound_is_carried_whole(bounded_repo: Store, sql: Sql) -> None:
    claim = run_to_join(bounded_repo, sql, fan_in(3), {"t0": 0, "t1": [1, 2, 3], "t2": None})
    assert claim.upstream == {"t0": 0, "t1": [1, 2, 3], "t2": None}
    assert claim.upstream_large == {} and claim.upstream_deferred is None


def test_a_fan_in_past_the_bound_carries_no_result_and_is_read_by_name(
    bounded_repo: Store, db: Database, sql: Sql
) -> None:
    results = {f"t{i}": {"n": i} for i in range(5)}
    claim = run_to_join(bounded_repo, sql, fan_in(5), results)
    assert claim.upstream == {} and claim.upstream_deferred == 5
    pages = Upstreams(db, inline=INLINE)
    upstream = bounded(claim, pages, 2)
    assert isinstance(upstream, UpstreamMap) and len(upstream) == 5
    assert upstream["t3"] == {"n": 3}
    with pytest.raises(KeyError):
        upstream["join"]
    assert list(upstream) == sorted(results)
    assert dict(upstream.items()) == results
    first = pages.names_page(claim.task_run_id, None, 2)
    assert first == [("t0", {"n": 0}), ("t1", {"n": 1})]
    assert pages.names_page(claim.task_run_id, "t3", 2, results=False) == [("t4", None)]


def test_a_long_list_past_the_bound_is_left_out_and_paged_from_the_result(
    bounded_repo: Store, db: Database, sql: Sql
) -> None:
    claim = run_to_join(bounded_repo, sql, fan_in(2), {"t0": list(range(7)), "t1": "x"})
    assert claim.upstream == {"t1": "x"}
    ref = claim.upstream_large["t0"]
    assert ref.length == 7 and not ref.items
    pages = Upstreams(db, inline=INLINE)
    assert pages.items_page(ref, 1, 3) == [(2, 2), (3, 3), (4, 4)]
    assert pages.items_page(ref, 5, 3) == [(6, 6)]
    view = bounded(claim, pages, 3)["t0"]
    assert isinstance(view, UpstreamList) and list(view) == list(range(7)) and view[-2] == 5


def mapped() -> WorkflowDef:
    return WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.noop", for_each="list"),
            TaskDef("other", "tests.noop"),
            TaskDef("join", "tests.noop", depends_on=("process", "other")),
        ),
    )


def test_a_wide_map_is_paged_from_its_items_rows_in_item_order(
    bounded_repo: Store, db: Database, sql: Sql
) -> None:
    claim = run_to_join(bounded_repo, sql, mapped(), {"list": list(range(8)), "other": 1})
    assert claim.upstream == {"other": 1}
    ref = claim.upstream_large["process"]
    assert ref == LargeUpstream(ref.task_run_id, 8, items=True)
    view = bounded(claim, Upstreams(db, inline=INLINE), 3)["process"]
    assert list(view) == [i * 10 for i in range(8)]
    assert view[5] == 50 and view[2:4] == [20, 30]
    # the same list the map stored, read another way
    stored = bounded_repo.get_task(ref.task_run_id).result
    assert view == stored


def test_a_short_map_result_travels_inline_as_before(bounded_repo: Store, sql: Sql) -> None:
    claim = run_to_join(bounded_repo, sql, mapped(), {"list": [1, 2], "other": 1})
    assert claim.upstream == {"process": [10, 20], "other": 1} and claim.upstream_large == {}


def test_a_list_changed_after_the_claim_raises_rather_than_reads_short(
    bounded_repo: Store, db: Database, sql: Sql
) -> None:
    claim = run_to_join(bounded_repo, sql, fan_in(1), {"t0": list(range(6))})
    ref = claim.upstream_large["t0"]
    sql.execute("UPDATE task_runs SET result = '[0, 1]' WHERE id = %s", (ref.task_run_id,))
    view = bounded(claim, Upstreams(db, inline=INLINE), 4)["t0"]
    assert len(view) == 6  # as the claim counted
    with pytest.raises(UpstreamChangedError, match=r"counted 6 elements, .* has 2"):
        view[1]
    with pytest.raises(UpstreamChangedError):
        list(view)


def test_local_runner_hands_a_handler_the_same_views_and_values(tmp_path: Any) -> None:
    """Equivalence: a join handler sees the same types and elements under LocalRunner."""
    seen: dict[str, Any] = {}

    def join(ctx: Any) -> Any:
        seen["type"] = type(ctx.upstream["process"]).__name__
        seen["len"] = len(ctx.upstream["process"])
        return sum(ctx.upstream["process"])

    handlers = {"tests.noop": lambda ctx: list(range(8)) if ctx.name == "list" else 1}
    wf = WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.item", for_each="list"),
            TaskDef("join", "tests.join", depends_on=("process",)),
        ),
    )
    runner = LocalRunner(
        [wf],
        {**handlers, "tests.item": lambda ctx: ctx.item * 10, "tests.join": join},
        upstream_inline_items=INLINE,
        upstream_page_items=3,
    )
    run = runner.run("mapped")
    assert run.state.value == "SUCCEEDED"
    assert seen == {"type": "UpstreamList", "len": 8} and run.tasks["join"].result == 280
