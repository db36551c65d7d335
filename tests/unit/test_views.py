"""The overview and stats read models, from the rows their statements return to the JSON the
api (``GET /api/v1/overview``) and the CLI (``flowforge stats --json``) send (no database).

The expected texts are the bytes these answers had when the store still returned dicts, so a
renamed field or a reordered key fails here (docs/dashboard-contract.md names the fields).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from enum import Enum
from uuid import UUID

from flowforge.domain.conditions import RunIf
from flowforge.domain.model import ChildRun, Overview, Progress, Run, Stats, TaskRun
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.store import rows
from flowforge.views import dumps, overview_dict, run_dict, stats_dict

TASK = UUID("7da4e7a0-fbe6-4e86-8bb3-d02a38755b38")
RUN = UUID("7fb7eb2c-fc85-44b9-9b88-1eb8476cb529")
DUE = datetime(2026, 12, 1, 18, 32, 42, 826314, tzinfo=UTC)
MINUTE = datetime(2026, 12, 1, 16, 33, tzinfo=UTC)
POISON_ROW = {
    "id": TASK,
    "run_id": RUN,
    "name": "only",
    "handler": "h.x",
    "state": "RETRYING",
    "attempt": 5,
    "failure_reason": "handler_error",
    "workflow": "golden",
}
BACKLOG_ROW = {"n": 1, "next_at": DUE, "latest_at": DUE}
POISON_JSON = (
    '[{"id": "7da4e7a0-fbe6-4e86-8bb3-d02a38755b38", "run_id": '
    '"7fb7eb2c-fc85-44b9-9b88-1eb8476cb529", "name": "only", "handler": "h.x", "state": '
    '"RETRYING", "attempt": 5, "failure_reason": "handler_error", "workflow": "golden"}]'
)
QUEUE_ROWS = [
    {"queue": None, "ready": 1, "estimated": False, "consumers": 0},
    {"queue": "partner", "ready": 3, "estimated": False, "consumers": 0},
]
QUEUES_JSON = (
    '"queues": [{"queue": null, "ready": 1, "consumers": 0, "estimated": false}, '
    '{"queue": "partner", "ready": 3, "consumers": 0, "estimated": false}], '
    '"unserved_queues": ["partner"]'
)
BACKLOG_JSON = (
    '{"n": 1, "next_at": "2026-12-01T18:32:42.826314+00:00", '
    '"latest_at": "2026-12-01T18:32:42.826314+00:00"}'
)


def overview(**changed: object) -> Overview:
    found: dict[str, object] = {
        "runs": [
            {"state": "RUNNING", "n": 1, "estimated": False},
            {"state": "FAILED", "n": 1, "estimated": False},
        ],
        "tasks": [
            {"state": "DEAD", "n": 1, "estimated": False},
            {"state": "RETRYING", "n": 1, "estimated": False},
        ],
        "minutes": [{"minute": MINUTE, "succeeded": 2, "dead": 1, "cancelled": 0}],
        "backlog": BACKLOG_ROW,
        "poison": [POISON_ROW],
        "dead": [{"reason": "permanent_error", "n": 1}, {"reason": "unknown", "n": 2}],
        "outbox": {"pending": 9, "oldest_s": 47.5},
        "processes": [{"host": "host-a", "role": "worker", "n": 2}],
        "queues": QUEUE_ROWS,
        **changed,
    }
    return rows.overview(**found)  # type: ignore[arg-type]


def test_the_overview_maps_its_rows_to_typed_fields() -> None:
    made = overview()
    assert made.runs["RUNNING"] == 1 and made.runs["SUCCEEDED"] == 0  # every state present
    assert set(made.tasks) == {str(s) for s in TaskState}
    (candidate,) = made.poison_candidates
    assert candidate.state is TaskState.RETRYING
    assert candidate.failure_reason is FailureReason.HANDLER_ERROR
    assert made.retry_backlog.next_at == DUE and made.outbox.oldest_s == 47.5


def test_the_overview_json_keeps_its_fields_in_order() -> None:
    assert dumps(overview_dict(overview())) == (
        '{"runs": {"SCHEDULED": 0, "PENDING": 0, "RUNNING": 1, "SUCCEEDED": 0, "FAILED": 1, '
        '"CANCELLED": 0}, '
        '"tasks": {"PENDING": 0, "READY": 0, "RUNNING": 0, "SUCCEEDED": 0, "FAILED": 0, '
        '"RETRYING": 1, "DEAD": 1, "CANCELLED": 0}, '
        '"finished_per_minute": [{"minute": "2026-12-01T16:33:00+00:00", "succeeded": 2, '
        '"dead": 1, "cancelled": 0}], '
        f'"retry_backlog": {BACKLOG_JSON}, "poison_candidates": {POISON_JSON}, '
        '"dead_by_reason": {"permanent_error": 1, "unknown": 2}, '
        '"outbox": {"pending": 9, "oldest_s": 47.5}, '
        '"processes": [{"host": "host-a", "role": "worker", "n": 2}], '
        f'{QUEUES_JSON}, "estimated": {{"runs": [], "tasks": []}}}}'
    )


def test_a_count_above_the_cap_is_marked_estimated() -> None:
    made = overview(
        tasks=[
            {"state": "SUCCEEDED", "n": 2_000_000, "estimated": True},
            {"state": "READY", "n": 7, "estimated": False},
        ],
        queues=[{"queue": "bulk", "ready": 100_001, "estimated": True, "consumers": 1}],
    )
    data = overview_dict(made)
    assert data["tasks"]["SUCCEEDED"] == 2_000_000 and data["tasks"]["READY"] == 7
    assert data["estimated"] == {"runs": [], "tasks": ["SUCCEEDED"]}
    assert data["queues"] == [
        {"queue": "bulk", "ready": 100_001, "consumers": 1, "estimated": True}
    ]


def test_an_empty_system_has_a_zero_backlog_and_outbox() -> None:
    made = overview(
        runs=[], tasks=[], backlog={"n": 0, "next_at": None, "latest_at": None}, poison=[]
    )
    data = overview_dict(made)
    assert data["retry_backlog"] == {"n": 0, "next_at": None, "latest_at": None}
    assert set(data["runs"].values()) == {0} and data["poison_candidates"] == []
    absent = overview_dict(overview(backlog=None, outbox=None))
    assert absent["retry_backlog"] == data["retry_backlog"]
    assert absent["outbox"] == {"pending": 0, "oldest_s": 0.0}


def stats(more: bool = False) -> Stats:
    return rows.stats(
        attempts=[
            {"attempt": 0, "n": 3, "estimated": False},
            {"attempt": 5, "n": 1, "estimated": False},
        ],
        reasons=[{"reason": "handler_error", "n": 5}],
        backlog=BACKLOG_ROW,
        poison=[POISON_ROW],
        dead=[
            {
                "workflow": "w",
                "handler": "h.y",
                "reason": "permanent_error",
                "n": 1,
                "newest_only": 10 if more else None,
            }
        ],
        queues=QUEUE_ROWS,
    )


def test_the_stats_json_keeps_its_fields_in_order() -> None:
    assert stats().dead[0].reason is FailureReason.PERMANENT_ERROR
    assert dumps(stats_dict(stats())) == (
        '{"attempts": {"0": 3, "5": 1}, "attempts_estimated": false, '
        '"failure_reasons": {"handler_error": 5}, '
        f'"retry_backlog": {BACKLOG_JSON}, "poison_candidates": {POISON_JSON}, '
        '"dead": [{"workflow": "w", "handler": "h.y", "reason": "permanent_error", "n": 1}], '
        f'"dead_newest_only": null, {QUEUES_JSON}}}'
    )


def test_dead_groups_over_the_newest_only_say_how_many_were_counted() -> None:
    """The statement counts the newest ``cap`` dead task runs and, when there are more, says how
    many it counted on every row; the read model (and its JSON) carries it, else None."""
    assert stats(more=False).dead_newest_only is None
    assert stats(more=True).dead_newest_only == 10
    assert stats_dict(stats(more=True))["dead_newest_only"] == 10


def _reference_dumps(data: object) -> str:
    """What views.dumps wrote before it kept one encoder: json.dumps with its default."""

    def default(value: object) -> object:
        if isinstance(value, datetime):
            return value.isoformat()
        if isinstance(value, UUID | Enum):
            return str(value)
        raise TypeError(type(value).__name__)

    return json.dumps(data, default=default)


def test_a_runs_json_is_asdicts_with_the_same_text() -> None:
    """run_dict walks each dataclass by its cached field names (docs/performance.md,
    "Submitting work, part 3"): the JSON is still what asdict made, field order included, for
    a run with every kind of value a read model holds (enums, ids, times, nested dataclasses,
    mappings, tuples, None)."""
    at = datetime(2026, 12, 3, 7, 30, tzinfo=UTC)
    task = TaskRun(
        id=UUID(int=1),
        run_id=UUID(int=2),
        name="t",
        handler="h",
        state=TaskState.RUNNING,
        attempt=1,
        max_attempts=3,
        fencing_token=4,
        failure_reason=FailureReason.TIMEOUT,
        last_error="boom",
        result={"b": [1, 2.5], "a": None},
        idempotency_key=None,
        ordering_key="o",
        lease_owner="w/1",
        lease_expires_at=at,
        retry_at=None,
        cancel_requested=False,
        created_at=at,
        ready_at=at,
        started_at=at,
        finished_at=None,
        depends_on=("a", "b"),
        sleep_s=1.5,
        for_each="a",
        item_counts={"READY": 2},
        run_if=RunIf.ANY_FAILED,
        progress=Progress(0.5, "half"),
        priority=7,
    )
    child = ChildRun("t", UUID(int=1), 1, UUID(int=3), "child", RunState.RUNNING)
    run = Run(
        id=UUID(int=2),
        workflow="w",
        state=RunState.RUNNING,
        input={"z": 1, "a": [True]},
        idempotency_key="k",
        cancel_requested=False,
        created_at=at,
        started_at=at,
        finished_at=None,
        tasks=(task,),
        deadline_at=at,
        children=(child,),
    )
    expected = {k: v for k, v in asdict(run).items() if k != "tasks"}
    expected["tasks"] = [{**asdict(task), "duration_s": None}]
    expected["compensated"] = []
    assert dumps(run_dict(run)) == _reference_dumps(expected)
    assert dumps(run_dict(run, with_tasks=False)) == _reference_dumps(
        {k: v for k, v in asdict(run).items() if k != "tasks"}
    )
