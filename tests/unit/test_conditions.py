"""run_if (SPEC 7.3): condition evaluation and the run-state precedence as pure functions, the
definition's validation (file, mapping, Python) and its digest, and the plan's condition gate."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.conditions import RunIf, Verdict, decide, is_conditional
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Run, TaskRun
from flowforge.domain.plan import plan_runs
from flowforge.domain.runstate import RunFacts, derive
from flowforge.domain.states import FINISHED_TASK_STATES, CancelCause, RunState, TaskState
from flowforge.errors import DefinitionError

S = TaskState
FAST = settings(database=None, deadline=None, max_examples=300)
UNFINISHED = sorted(set(TaskState) - FINISHED_TASK_STATES)


# ------------------------------------------------------------------ decide


@pytest.mark.parametrize("run_if", [RunIf.ALL_DONE, RunIf.ANY_FAILED])
@pytest.mark.parametrize("waiting", UNFINISHED)
def test_a_condition_waits_while_a_dependency_can_still_change(
    run_if: RunIf, waiting: TaskState
) -> None:
    assert decide(run_if, [S.DEAD, waiting]) is Verdict.WAIT


@pytest.mark.parametrize(
    "upstream", [[S.SUCCEEDED], [S.DEAD], [S.CANCELLED], [S.SUCCEEDED, S.DEAD, S.CANCELLED]]
)
def test_all_done_runs_whatever_the_finished_outcomes(upstream: list[TaskState]) -> None:
    assert decide(RunIf.ALL_DONE, upstream) is Verdict.RUN


def test_any_failed_runs_when_a_dependency_is_dead() -> None:
    assert decide("any_failed", ["SUCCEEDED", "DEAD"]) is Verdict.RUN


@pytest.mark.parametrize("upstream", [[S.SUCCEEDED], [S.CANCELLED], [S.SUCCEEDED, S.CANCELLED]])
def test_any_failed_is_skipped_without_a_dead_dependency(upstream: list[TaskState]) -> None:
    # a cancelled dependency never ran: nothing to compensate
    assert decide(RunIf.ANY_FAILED, upstream) is Verdict.SKIP


def test_all_succeeded_and_no_dependency_are_not_evaluated() -> None:
    with pytest.raises(ValueError, match="not a gated condition"):
        decide(RunIf.ALL_SUCCEEDED, [S.SUCCEEDED])
    with pytest.raises(ValueError, match="at least one dependency"):
        decide(RunIf.ALL_DONE, [])


def test_only_the_default_is_unconditional() -> None:
    assert [is_conditional(r) for r in RunIf] == [False, True, True]


@FAST
@given(
    st.sampled_from([RunIf.ALL_DONE, RunIf.ANY_FAILED]), st.lists(st.sampled_from(S), min_size=1)
)
def test_decide_is_total_and_waits_exactly_while_something_can_change(
    run_if: RunIf, upstream: list[TaskState]
) -> None:
    verdict = decide(run_if, upstream)
    settled = all(s in FINISHED_TASK_STATES for s in upstream)
    assert (verdict is Verdict.WAIT) == (not settled)
    if settled and run_if is RunIf.ANY_FAILED:
        assert (verdict is Verdict.RUN) == (S.DEAD in upstream)


# ------------------------------------------------------------------ run state with skips


def test_a_run_whose_compensation_was_skipped_succeeded() -> None:
    assert derive(RunFacts({S.SUCCEEDED: 2, S.CANCELLED: 1}, True, skipped=1)) is RunState.SUCCEEDED


def test_a_compensated_run_still_failed() -> None:
    assert derive(RunFacts({S.SUCCEEDED: 2, S.DEAD: 1}, True)) is RunState.FAILED


def test_a_real_cancellation_beside_a_skip_is_cancelled() -> None:
    facts = RunFacts({S.SUCCEEDED: 1, S.CANCELLED: 2}, True, skipped=1)
    assert derive(facts) is RunState.CANCELLED


def test_an_operator_cancel_of_skipped_tasks_only_is_still_cancelled() -> None:
    facts = RunFacts({S.SUCCEEDED: 1, S.CANCELLED: 1}, True, cancel_requested=True, skipped=1)
    assert derive(facts) is RunState.CANCELLED


@st.composite
def facts_with_skips(draw: Any) -> RunFacts:
    counts = draw(st.dictionaries(st.sampled_from(list(TaskState)), st.integers(0, 5)))
    skipped = draw(st.integers(0, counts.get(S.CANCELLED, 0)))
    return RunFacts(
        counts,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        skipped=skipped,
    )


@FAST
@given(facts_with_skips())
def test_skips_never_make_a_run_cancelled_nor_hide_a_failure(f: RunFacts) -> None:
    state = derive(f)
    if state is RunState.SUCCEEDED:
        assert f.count(S.SUCCEEDED) + f.skipped == f.total and f.count(S.DEAD) == 0
    if state is RunState.CANCELLED:
        assert f.cancel_requested or f.count(S.CANCELLED) > f.skipped
    if f.finished and f.count(S.DEAD) and not f.cancel_requested:
        assert state is RunState.FAILED


# ------------------------------------------------------------------ definitions


def saga(**refund: Any) -> dict[str, Any]:
    return {
        "name": "saga",
        "tasks": [
            {"name": "charge", "handler": "p.charge"},
            {"name": "ship", "handler": "p.ship", "depends_on": ["charge"]},
            {"name": "refund", "handler": "p.refund", "depends_on": ["ship"], **refund},
        ],
    }


def test_run_if_is_read_from_a_mapping_and_round_trips() -> None:
    wf = workflow_from_mapping(saga(run_if="any_failed"))
    assert wf.task("refund").run_if is RunIf.ANY_FAILED
    assert wf.to_dict()["tasks"][2]["run_if"] == "any_failed"
    assert workflow_from_mapping(wf.to_dict()) == wf


def test_the_default_run_if_keeps_existing_digests() -> None:
    plain = workflow_from_mapping(saga())
    explicit = workflow_from_mapping(saga(run_if="all_succeeded"))
    assert "run_if" not in plain.to_dict()["tasks"][2]
    assert plain.digest == explicit.digest
    assert workflow_from_mapping(saga(run_if="all_done")).digest != plain.digest


@pytest.mark.parametrize("bad", ["sometimes", "", 3, None, ["any_failed"], "ANY_FAILED", "a\x00"])
def test_a_bad_run_if_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(DefinitionError, match=r"run_if"):
        workflow_from_mapping(saga(run_if=bad))


def test_run_if_on_a_task_without_dependencies_is_refused() -> None:
    with pytest.raises(DefinitionError, match="run_if: any_failed needs depends_on"):
        TaskDef("lonely", "p.x", run_if=RunIf.ANY_FAILED)


def test_python_code_may_give_run_if_as_text() -> None:
    task = TaskDef("undo", "p.x", depends_on=("a",), run_if="all_done")  # type: ignore[arg-type]
    assert task.run_if is RunIf.ALL_DONE
    with pytest.raises(DefinitionError, match="run_if must be one of"):
        TaskDef("undo", "p.x", depends_on=("a",), run_if="often")  # type: ignore[arg-type]


def test_a_timer_can_be_conditional() -> None:
    wf = WorkflowDef(
        "w",
        (TaskDef("a", "p.a"), TaskDef("t", sleep=5.0, depends_on=("a",), run_if=RunIf.ALL_DONE)),
    )
    assert wf.to_dict()["tasks"][1] == {
        "name": "t",
        "depends_on": ["a"],
        "sleep": 5.0,
        "run_if": "all_done",
    }


# ------------------------------------------------------------------ plan and read model


def test_a_conditional_task_is_planned_behind_its_condition_gate() -> None:
    wf = workflow_from_mapping(saga(run_if="any_failed"))
    plan = plan_runs(wf, [{}])
    pending = {t.name: (t.pending, t.run_if) for t in plan.tasks}
    assert pending == {
        "charge": (0, "all_succeeded"),
        "ship": (1, "all_succeeded"),
        "refund": (2, "any_failed"),  # ship, and the gate only evaluate_conditions opens
    }


def _task(name: str, state: TaskState, run_if: RunIf, cause: CancelCause | None = None) -> TaskRun:
    from datetime import UTC, datetime
    from uuid import uuid4

    return TaskRun(
        uuid4(), uuid4(), name, "h", state, 1, 3, 1, None, None, None, None, None, None, None,
        None, False, datetime.now(UTC), None, None, None, run_if=run_if, cancel_cause=cause,
    )  # fmt: skip


def test_a_run_says_what_was_compensated() -> None:
    from datetime import UTC, datetime
    from uuid import uuid4

    tasks = (
        _task("ship", S.DEAD, RunIf.ALL_SUCCEEDED),
        _task("refund", S.SUCCEEDED, RunIf.ANY_FAILED),
        _task("release", S.CANCELLED, RunIf.ANY_FAILED, CancelCause.CONDITION_NOT_MET),
        _task("tidy", S.SUCCEEDED, RunIf.ALL_DONE),
    )
    run = Run(uuid4(), "w", RunState.FAILED, {}, None, False, datetime.now(UTC), None, None, tasks)
    assert run.compensated == ("refund",)
    assert [t.skipped for t in tasks] == [False, False, True, False]
