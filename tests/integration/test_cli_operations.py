"""The operator commands of `flowforge` (SPEC 5): stats, ps, runs, cancel, dead, workflows validate.

The real command (``python -m flowforge.cli`` in a process of its own, forked off a preloaded
interpreter by tests/cli_runner.py) against a real database whose contents are made by driving
the store (trigger, scheduler passes, claim, finish) or, for ``ps``, by registering as roles
do. Operator mistakes give one stderr line, a distinct exit code and no traceback. The
basics (trigger, status, config errors, unknown ids for status/cancel/requeue) are in
test_cli.py.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.roles.presence import Presence
from tests import cli_runner
from tests.helpers import FAST_RETRY, bury, claim_task, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

REPO = Path(__file__).resolve().parents[2]
UNKNOWN_ID = "00000000-0000-0000-0000-000000000000"

NO_DELAY_5 = RetryPolicy(max_attempts=5, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
IN_AN_HOUR = RetryPolicy(max_attempts=5, base_delay=3600, max_delay=3600, jitter=Jitter.NONE)
IN_TWO_HOURS = RetryPolicy(max_attempts=5, base_delay=7200, max_delay=7200, jitter=Jitter.NONE)


def one_task(name: str, handler: str, retry: RetryPolicy = FAST_RETRY) -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("only", handler, retry=retry),))


OK = one_task("stats-ok", "tests.ok")
POISON = one_task("stats-poison", "tests.poison", NO_DELAY_5)
SOON = one_task("stats-soon", "tests.soon", IN_AN_HOUR)
LATER = one_task("stats-later", "tests.later", IN_TWO_HOURS)
PERMANENT = one_task("stats-perm", "tests.perm")
EXHAUST = one_task("stats-exhaust", "tests.exhaust")
CHAIN = WorkflowDef(
    "ops-chain",
    (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop", depends_on=("a",))),
)


# ------------------------------------------------------------------ running the command


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text("workflows: []\n")
    return path


def flowforge(
    *args: str, url: str | None, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    if url is not None:
        env["FLOWFORGE_DATABASE_URL"] = url
    config_args = ("-c", str(config)) if config is not None else ()
    return cli_runner.run([*config_args, *args], env, cwd=REPO)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(result))


def assert_operator_error(
    result: subprocess.CompletedProcess[str], code: int, fragment: str
) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def table_rows(text: str) -> list[list[str]]:
    """An aligned table's lines, split into cells (cells never contain two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


# ------------------------------------------------------------------ driving the repository


def succeed(repo: Store, sql: Sql, task_id: UUID) -> None:
    claim = claim_task(repo, sql, task_id)
    assert repo.finish(task_id, claim.fencing_token, TaskState.SUCCEEDED, result={"ok": True})


def fail(
    repo: Store,
    sql: Sql,
    task_id: UUID,
    reason: FailureReason = FailureReason.HANDLER_ERROR,
    error: str = "boom",
    worker: str = "worker-1",
) -> None:
    claim = claim_task(repo, sql, task_id, worker=worker)
    assert repo.finish(task_id, claim.fencing_token, TaskState.FAILED, reason=reason, error=error)
    drain(repo)


def start(repo: Store, workflow: WorkflowDef, run_input: dict[str, Any] | None = None) -> UUID:
    """Trigger a one-task run and make its task READY; returns the task run id."""
    run_id = repo.trigger(workflow, run_input).run_id
    drain(repo)
    return task_ids(repo, run_id)["only"]


def exhausted(repo: Store, sql: Sql, workflow: WorkflowDef = EXHAUST) -> UUID:
    """A task run DEAD after three handler errors ("boom 1..3" on "worker-1..3")."""
    task_id = start(repo, workflow)
    for n in (1, 2, 3):
        fail(repo, sql, task_id, error=f"boom {n}", worker=f"worker-{n}")
    assert repo.get_task(task_id).state is TaskState.DEAD
    return task_id


def stats_data(repo: Store, sql: Sql) -> dict[str, UUID]:
    """One task run of each kind ``stats`` reports on, by kind."""
    made = {"ok": start(repo, OK), "poison": start(repo, POISON)}
    succeed(repo, sql, made["ok"])
    for n in (1, 2, 3):  # no delay: back to READY at once, with 3 attempts used
        fail(repo, sql, made["poison"], error=f"poison {n}")
    made["soon"], made["later"] = start(repo, SOON), start(repo, LATER)
    fail(repo, sql, made["soon"])
    fail(repo, sql, made["later"])
    for n in (1, 2):
        made[f"perm{n}"] = start(repo, PERMANENT, {"n": n})
        fail(repo, sql, made[f"perm{n}"], reason=FailureReason.PERMANENT_ERROR)
    made["exhaust"] = exhausted(repo, sql)
    expected = {
        "ok": TaskState.SUCCEEDED,
        "poison": TaskState.READY,
        "soon": TaskState.RETRYING,
        "later": TaskState.RETRYING,
        "perm1": TaskState.DEAD,
        "perm2": TaskState.DEAD,
        "exhaust": TaskState.DEAD,
    }
    assert {k: repo.get_task(v).state for k, v in made.items()} == expected
    return made


# ------------------------------------------------------------------ stats


def test_stats_on_an_empty_database(clean_database_url: str, config: Path) -> None:
    assert ok_json(flowforge("stats", "--json", url=clean_database_url, config=config)) == {
        "attempts": {},
        "attempts_estimated": False,
        "failure_reasons": {},
        "retry_backlog": {"n": 0, "next_at": None, "latest_at": None},
        "poison_candidates": [],
        "dead": [],
        "dead_newest_only": None,
        "queues": [],
        "unserved_queues": [],
    }
    text = ok(flowforge("stats", url=clean_database_url, config=config))
    assert "retry backlog: 0 waiting, next -, latest -" in text


def test_stats_reports_retries_reasons_backlog_poison_and_dead(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    made = stats_data(repo, sql)
    data = ok_json(flowforge("stats", "--json", url=clean_database_url, config=config))
    assert set(data) == {
        "attempts",
        "attempts_estimated",
        "failure_reasons",
        "retry_backlog",
        "poison_candidates",
        "dead",
        "dead_newest_only",
        "queues",
        "unserved_queues",
    }
    assert data["dead_newest_only"] is None  # three dead task runs: every one counted
    # attempts used: ok, soon, later and both permanent ones 1; poison and exhaust 3
    assert data["attempts"] == {"1": 5, "3": 2}
    # every failed attempt: poison 3 + soon 1 + later 1 + exhaust 3; permanent 2
    assert data["failure_reasons"] == {"handler_error": 8, "permanent_error": 2}

    backlog = data["retry_backlog"]
    assert backlog["n"] == 2
    next_at = datetime.fromisoformat(backlog["next_at"])
    latest_at = datetime.fromisoformat(backlog["latest_at"])
    assert next_at == repo.get_task(made["soon"]).retry_at
    assert latest_at == repo.get_task(made["later"]).retry_at
    assert abs((latest_at - next_at) - timedelta(hours=1)) < timedelta(seconds=30)

    poison = {p["id"]: p for p in data["poison_candidates"]}
    assert str(made["poison"]) in poison
    candidate = poison[str(made["poison"])]
    assert {k: candidate[k] for k in ("workflow", "name", "handler", "state", "attempt")} == {
        "workflow": "stats-poison",
        "name": "only",
        "handler": "tests.poison",
        "state": "READY",
        "attempt": 3,
    }
    assert candidate["failure_reason"] == "handler_error"
    assert not {str(made[k]) for k in ("ok", "soon", "later", "perm1", "perm2")} & poison.keys()

    assert data["dead"] == [
        {"workflow": "stats-perm", "handler": "tests.perm", "reason": "permanent_error", "n": 2},
        {
            "workflow": "stats-exhaust",
            "handler": "tests.exhaust",
            "reason": "max_attempts_exceeded",
            "n": 1,
        },
    ]

    lower = ok_json(
        flowforge(
            "stats", "--json", "--poison-threshold", "1", url=clean_database_url, config=config
        )
    )
    lowered = {p["id"] for p in lower["poison_candidates"]}
    assert {str(made[k]) for k in ("poison", "soon", "later")} <= lowered
    assert str(made["ok"]) not in lowered  # finished work is never a candidate

    text = ok(flowforge("stats", url=clean_database_url, config=config))
    sections = [
        "attempts used per task run:",
        "failure reasons (all attempts):",
        "retry backlog: 2 waiting, next ",
        "poison candidates (>= 3 attempts, unfinished):",
        "dead tasks:",
    ]
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions)
    rows = table_rows(text)
    assert ["1", "5"] in rows and ["3", "2"] in rows
    assert ["handler_error", "8"] in rows and ["permanent_error", "2"] in rows
    assert ["stats-perm", "tests.perm", "permanent_error", "2"] in rows
    assert ["stats-exhaust", "tests.exhaust", "max_attempts_exceeded", "1"] in rows
    assert [str(made["poison"]), "stats-poison", "only", "READY", "3", "handler_error"] in rows
    soon = repo.get_task(made["soon"]).retry_at
    assert soon is not None and f"next {soon:%Y-%m-%d %H:%M}" in text


def test_stats_counts_the_newest_dead_tasks_only_above_its_cap(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    """Each dead task's run is looked up to name its workflow, so ``stats`` groups at most the
    newest ``dead_cap`` of them (10,000 in the product; a store keeps dead tasks until they
    are purged) and says so; at the cap or below, every one."""
    stats_data(repo, sql)
    newest = sql.execute(
        "SELECT r.workflow FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
        " WHERE t.state = 'DEAD' ORDER BY t.finished_at DESC, t.id DESC"
    ).fetchall()
    assert len(newest) == 3
    for cap in (1, 2, 3):
        stats = repo.stats(3, dead_cap=cap)
        counted = Counter(str(w) for (w,) in newest[:cap])
        assert {d.workflow: d.n for d in stats.dead} == dict(counted), cap
        assert stats.dead_newest_only == (cap if cap < 3 else None)
    text = ok(flowforge("stats", url=clean_database_url, config=config))
    assert "dead tasks:\n" in text  # the product's cap is far above three


def test_stats_poison_candidates_leave_out_dead_tasks(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    """``stats`` says "poison candidates (>= N attempts, unfinished)": a DEAD task is finished
    (it is reported under "dead tasks"), so only the live poison task is a candidate."""
    made = stats_data(repo, sql)
    data = ok_json(flowforge("stats", "--json", url=clean_database_url, config=config))
    assert [p["id"] for p in data["poison_candidates"]] == [str(made["poison"])]


def test_stats_refuses_a_threshold_below_one(clean_database_url: str, config: Path) -> None:
    assert_operator_error(
        flowforge("stats", "--poison-threshold", "0", url=clean_database_url, config=config),
        exitcodes.USAGE,
        "--poison-threshold",
    )


# ------------------------------------------------------------------ ps


def test_ps_lists_the_registered_processes(
    repo: Store, clean_database_url: str, config: Path
) -> None:
    """Registered as a role registers itself (its ``Presence``: this process's host and pid);
    real role processes doing so: tests/integration/test_roles_delivery.py (``slow``)."""
    url = clean_database_url
    assert ok_json(flowforge("ps", "--json", url=url, config=config)) == []
    scheduler, worker = Presence(repo, "scheduler"), Presence(repo, "worker")
    scheduler.announce()
    worker.announce()
    wanted = {(os.getpid(), "scheduler"), (os.getpid(), "worker")}
    processes = ok_json(flowforge("ps", "--json", url=url, config=config))
    assert {(p["pid"], p["role"]) for p in processes} == wanted
    for process in processes:
        assert {"id", "host", "pid", "role", "started_at", "last_seen_at", "silent_s"} <= set(
            process
        )
        assert 0 <= process["silent_s"] < 30
    rows = table_rows(ok(flowforge("ps", url=url, config=config)))
    assert rows[0] == ["HOST", "PID", "ROLE", "STARTED", "LAST SEEN", "SILENT S", "QUEUE"]
    assert sorted((int(r[1]), r[2]) for r in rows[1:]) == sorted(wanted)

    scheduler.leave()  # a clean stop deregisters
    left = ok_json(flowforge("ps", "--json", url=url, config=config))
    assert [(p["pid"], p["role"]) for p in left] == [(os.getpid(), "worker")]


# ------------------------------------------------------------------ runs and cancel


def test_runs_filters_by_state_and_workflow_and_limits(
    repo: Store, clean_database_url: str, config: Path
) -> None:
    a = [repo.trigger(one_task("runs-a", "tests.noop"), {"n": n}).run_id for n in range(3)]
    b = [repo.trigger(one_task("runs-b", "tests.noop"), {"n": n}).run_id for n in range(2)]
    repo.cancel_run(a[1])
    newest_first = [str(r) for r in reversed(a + b)]

    def ids(*args: str) -> list[str]:
        found = ok_json(flowforge("runs", "--json", *args, url=clean_database_url, config=config))
        assert all("tasks" not in r and {"id", "workflow", "state"} <= r.keys() for r in found)
        return [r["id"] for r in found]

    assert ids() == newest_first
    assert ids("--workflow", "runs-b") == [str(r) for r in reversed(b)]
    assert ids("--state", "cancelled") == [str(a[1])]
    assert ids("--state", "PENDING", "--workflow", "runs-a") == [str(a[2]), str(a[0])]
    assert ids("--limit", "2") == newest_first[:2]

    rows = table_rows(ok(flowforge("runs", url=clean_database_url, config=config)))
    assert rows[0] == ["ID", "WORKFLOW", "STATE", "CREATED", "FINISHED"]
    assert [r[0] for r in rows[1:]] == newest_first
    assert [str(a[1]), "runs-a", "CANCELLED"] == rows[1:][newest_first.index(str(a[1]))][:3]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--limit", "0"), "--limit"),
        (("--limit", "1001"), "--limit"),
        (("--limit", "ten"), "invalid int value"),
    ],
)
def test_runs_refuses_bad_options(
    clean_database_url: str, config: Path, args: tuple[str, ...], fragment: str
) -> None:
    assert_operator_error(
        flowforge("runs", *args, url=clean_database_url, config=config), exitcodes.USAGE, fragment
    )


def test_cancel_json_prints_the_cancelled_run(
    repo: Store, clean_database_url: str, config: Path
) -> None:
    run_id = str(repo.trigger(CHAIN).run_id)
    cancelled = ok_json(
        flowforge("cancel", run_id, "--json", url=clean_database_url, config=config)
    )
    assert cancelled["id"] == run_id and cancelled["state"] == "CANCELLED"
    assert [(t["name"], t["state"], t["failure_reason"]) for t in cancelled["tasks"]] == [
        ("a", "CANCELLED", "cancelled"),
        ("b", "CANCELLED", "cancelled"),
    ]
    status = ok_json(flowforge("status", run_id, "--json", url=clean_database_url, config=config))
    assert status == cancelled
    other = str(repo.trigger(CHAIN).run_id)
    text = ok(flowforge("cancel", other, url=clean_database_url, config=config))
    assert text.strip() == f"run {other} is CANCELLED"


# ------------------------------------------------------------------ dead tasks


def test_dead_list_and_show_with_attempts(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    assert ok_json(flowforge("dead", "list", "--json", url=clean_database_url, config=config)) == []
    task_id = str(exhausted(repo, sql))
    listed = ok_json(flowforge("dead", "list", "--json", url=clean_database_url, config=config))
    assert [(t["id"], t["state"], t["failure_reason"], t["attempt"]) for t in listed] == [
        (task_id, "DEAD", "max_attempts_exceeded", 3)
    ]
    assert listed[0]["last_error"] == "boom 3"
    rows = table_rows(ok(flowforge("dead", "list", url=clean_database_url, config=config)))
    assert rows[0][:3] == ["ID", "RUN", "TASK"]
    assert rows[1][0] == task_id and "max_attempts_exceeded" in rows[1]

    shown = ok_json(
        flowforge("dead", "show", task_id, "--json", url=clean_database_url, config=config)
    )
    assert (shown["id"], shown["state"], shown["failure_reason"]) == (
        task_id,
        "DEAD",
        "max_attempts_exceeded",
    )
    assert [
        (a["attempt"], a["worker"], a["outcome"], a["failure_reason"], a["error"])
        for a in shown["attempts"]
    ] == [(n, f"worker-{n}", "failed", "handler_error", f"boom {n}") for n in (1, 2, 3)]
    for attempt in shown["attempts"]:
        assert attempt["started_at"] and attempt["finished_at"]
        assert attempt["duration_s"] is not None and attempt["duration_s"] >= 0

    text = ok(flowforge("dead", "show", task_id, url=clean_database_url, config=config))
    assert text.startswith(f"task run {task_id}  only (tests.exhaust)  state DEAD")
    attempt_rows = [r for r in table_rows(text) if r[0] in ("1", "2", "3")]
    assert [(r[0], r[1], r[2], r[-1]) for r in attempt_rows] == [
        (str(n), f"worker-{n}", "failed", f"boom {n}") for n in (1, 2, 3)
    ]


@pytest.mark.parametrize(
    ("task_run_id", "code", "fragment"),
    [
        (UNKNOWN_ID, exitcodes.NOT_FOUND, "no task run with id"),
        ("not-an-id", exitcodes.USAGE, "malformed task run id"),
    ],
)
def test_dead_show_of_an_unknown_or_malformed_id_fails(
    clean_database_url: str, config: Path, task_run_id: str, code: int, fragment: str
) -> None:
    assert_operator_error(
        flowforge("dead", "show", task_run_id, url=clean_database_url, config=config),
        code,
        fragment,
    )


def test_dead_requeue_records_who_and_why_and_refuses_a_second_time(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    first, second = str(exhausted(repo, sql)), str(exhausted(repo, sql))
    args = ("--reason", "fixed in 1.2.3", "--by", "ops")
    out = ok(flowforge("dead", "requeue", first, *args, url=clean_database_url, config=config))
    assert out.strip() == f"task run {first} requeued: PENDING"
    assert_operator_error(
        flowforge("dead", "requeue", first, *args, url=clean_database_url, config=config),
        exitcodes.REFUSED,
        "not DEAD",
    )
    ok(flowforge("dead", "requeue", second, url=clean_database_url, config=config))
    audit = sql.execute(
        "SELECT task_run_id::text, requested_by, reason, previous_reason, attempt"
        " FROM requeue_audit ORDER BY id"
    ).fetchall()
    assert audit == [
        (first, "ops", "fixed in 1.2.3", "max_attempts_exceeded", 3),
        (second, getpass.getuser(), None, "max_attempts_exceeded", 3),
    ]
    task = repo.get_task(first)
    assert (task.state, task.failure_reason) == (TaskState.PENDING, None)
    assert ok_json(flowforge("dead", "list", "--json", url=clean_database_url, config=config)) == []


# ------------------------------------------------------------------ workflows validate

BAD_WORKFLOWS = {
    "cycle": (
        "name: c\ntasks:\n  - name: a\n    handler: x\n    depends_on: [b]\n"
        "  - name: b\n    handler: x\n    depends_on: [a]\n",
        "dependency cycle",
    ),
    "unknown-dependency": (
        "name: u\ntasks:\n  - name: a\n    handler: x\n    depends_on: [zz]\n",
        "unknown task 'zz'",
    ),
    "duplicate-task": (
        "name: d\ntasks:\n  - name: a\n    handler: x\n  - name: a\n    handler: x\n",
        "duplicate task name 'a'",
    ),
    "invalid-yaml": ("name: [\n", "not valid YAML"),
    "bad-retry": (
        "name: r\ntasks:\n  - name: a\n    handler: x\n    retry: {max_attempts: 0}\n",
        "max_attempts must be at least 1",
    ),
    "unknown-key": ("name: k\ntasks:\n  - name: a\n    handler: x\n    retries: 3\n", "retries"),
    # schedules (SPEC 7.2): the line names the field
    "bad-cron": (
        "name: s\ntasks: [{name: a, handler: x}]\nschedules: [{cron: '0 25 * * *'}]\n",
        "schedules[0].cron: '0 25 * * *': bad hour",
    ),
    "unknown-timezone": (
        "name: s\ntasks: [{name: a, handler: x}]\n"
        "schedules: [{cron: '@daily', timezone: Moon/Base}]\n",
        "schedules[0].timezone: unknown time zone 'Moon/Base'",
    ),
    "every-zero": (
        "name: s\ntasks: [{name: a, handler: x}]\nschedules: [{every: 0s}]\n",
        "schedules[0].every: '0s' is not a duration",
    ),
    "cron-and-every": (
        "name: s\ntasks: [{name: a, handler: x}]\nschedules: [{every: 1s, cron: '@daily'}]\n",
        "schedules[0].cron: give exactly one of cron and every",
    ),
    "bad-overlap": (
        "name: s\ntasks: [{name: a, handler: x}]\nschedules: [{every: 1s, overlap: queue}]\n",
        "schedules[0].overlap: must be one of allow, skip, cancel_previous",
    ),
}


@pytest.fixture
def handler_config(tmp_path: Path) -> Path:
    """A config whose handler module (next to it) registers the handler ``x``."""
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "ff_validate_handlers.py").write_text(
        "from flowforge import task\n\n\n@task('x')\ndef x(ctx):\n    return None\n"
    )
    path = folder / "flowforge.yaml"
    path.write_text("handlers: [ff_validate_handlers]\nworkflows: []\n")
    return path


@pytest.mark.parametrize("kind", sorted(BAD_WORKFLOWS))
def test_workflows_validate_a_bad_file_gives_one_line_and_exit_2(
    tmp_path: Path, handler_config: Path, kind: str
) -> None:
    text, fragment = BAD_WORKFLOWS[kind]
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    paths = [path]
    if kind == "cycle":  # a bad file among good ones still fails the whole check
        good = tmp_path / "good.yaml"
        good.write_text("name: good\ntasks:\n  - name: a\n    handler: x\n")
        paths.insert(0, good)
    result = flowforge("workflows", "validate", *map(str, paths), url=None, config=handler_config)
    assert_operator_error(result, exitcodes.USAGE, fragment)
    assert str(path) in result.stderr


def test_workflows_validate_good_files_and_a_missing_one(
    tmp_path: Path, handler_config: Path
) -> None:
    config = handler_config
    folder = tmp_path / "workflows"
    folder.mkdir()
    for name in ("one", "two"):
        (folder / f"{name}.yaml").write_text(f"name: {name}\ntasks:\n  - name: a\n    handler: x\n")
    out = ok(flowforge("workflows", "validate", str(folder), url=None, config=config))
    assert out.strip() == "2 workflow(s) valid: one, two"
    missing = tmp_path / "missing.yaml"
    result = flowforge("workflows", "validate", str(missing), url=None, config=config)
    assert_operator_error(result, exitcodes.USAGE, str(missing))


# ------------------------------------------------------------------ trigger input


@pytest.mark.parametrize(
    "text",
    ['{"x": NaN}', '{"x": Infinity}', '{"x": 1e400}', '{"x": "a\\u0000b"}'],
    ids=["nan", "infinity", "overflowing-float", "nul-character"],
)
def test_trigger_input_the_database_cannot_store_is_a_usage_error(
    clean_database_url: str, sql: Sql, text: str
) -> None:
    """JSON that Python parses but PostgreSQL's jsonb refuses is the operator's mistake (exit 2),
    not an internal error."""
    example = REPO / "config" / "flowforge.example.yaml"
    result = flowforge("trigger", "hello", "--input", text, url=clean_database_url, config=example)
    assert_operator_error(result, exitcodes.USAGE, "input")
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


# ------------------------------------------------------------------ every validation error

MANY_PROBLEMS = """\
name: many
tasks:
  - name: a
    handler: x
    timeout: soon
  - name: b
    handler: not.registered
    retries: 3
  - name: c
    handler: x
    handler: x
"""


def test_workflows_validate_reports_every_problem_one_line_each(
    tmp_path: Path, handler_config: Path
) -> None:
    folder = tmp_path / "workflows"
    folder.mkdir()
    many = folder / "a-many.yaml"
    many.write_text(MANY_PROBLEMS)
    broken = folder / "b-broken.yaml"
    broken.write_text("name: broken\ntasks: [\n")
    (folder / "c-good.yaml").write_text("name: good\ntasks:\n  - {name: a, handler: x}\n")
    result = flowforge("workflows", "validate", str(folder), url=None, config=handler_config)
    assert result.returncode == exitcodes.USAGE and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"flowforge: {many}:5: tasks[0].timeout: expected a number, got a string",
        f"flowforge: {many}:7: tasks[1].handler: no configured handler module registers "
        "'not.registered'",
        f"flowforge: {many}:8: tasks[1].retries: unknown key",
        f"flowforge: {many}:11: duplicate key 'handler' (first at line 10)",
        f"flowforge: {broken}:3:1: not valid YAML: expected the node content, but found "
        "'<stream end>' (while parsing a flow node)",
    ]


def test_workflows_validate_checks_handlers_against_the_configured_modules(
    tmp_path: Path, handler_config: Path, config: Path
) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text("name: w\ntasks:\n  - {name: a, handler: x}\n")
    ok(flowforge("workflows", "validate", str(path), url=None, config=handler_config))
    # the same file with a config that imports no handler module: nothing could run it
    result = flowforge("workflows", "validate", str(path), url=None, config=config)
    assert_operator_error(result, exitcodes.USAGE, "no configured handler module registers 'x'")
    broken = handler_config.with_name("broken.yaml")
    broken.write_text("handlers: [ff_no_such_module]\n")
    result = flowforge("workflows", "validate", str(path), url=None, config=broken)
    assert_operator_error(result, exitcodes.USAGE, "cannot import 'ff_no_such_module'")


# ------------------------------------------------------------------ stored text on a terminal

#: An error a handler could raise: terminal escapes (colour, clear screen, window title, the
#: one-byte C1 CSI), a carriage return that would overwrite the line, DEL, a bidi override.
HOSTILE_FIRST_LINE = (
    "\x1b[31mred\x1b[0m \x1b[2J\x1b]0;pwned\x07 \x9b1A \rforged\x7f \u202eeman "
    + "long " * 20
    + "end-of-first-line"
)
HOSTILE_ERROR = HOSTILE_FIRST_LINE + "\nsecond line\n\x1b[1mthird\x1b[0m"
TRACEBACK = 'Traceback (most recent call last):\n  File "h.py", line 3, in h\nValueError: \x1b[5mx'


def dead_with_hostile_error(repo: Store, sql: Sql) -> UUID:
    task_id = start(repo, PERMANENT, {"hostile": 1})
    bury(repo, sql, task_id, error=HOSTILE_ERROR, traceback=TRACEBACK)
    return task_id


def assert_terminal_safe(text: str) -> None:
    unsafe = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]
    assert not unsafe, unsafe
    assert "\u202e" not in text


def test_dead_show_prints_the_whole_first_line_and_full_prints_everything_escaped(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    task_id = str(dead_with_hostile_error(repo, sql))
    shown = ok(flowforge("dead", "show", task_id, url=clean_database_url, config=config))
    assert_terminal_safe(shown)
    escaped = (
        "\\x1b[31mred\\x1b[0m \\x1b[2J\\x1b]0;pwned\\x07 \\x9b1A \\rforged\\x7f \\u202eeman "
        + "long " * 20
        + "end-of-first-line"
    )
    assert shown.splitlines()[-1].endswith(escaped)  # the whole first line, not 60 characters
    assert "second line" not in shown
    full = ok(flowforge("dead", "show", task_id, "--full", url=clean_database_url, config=config))
    assert_terminal_safe(full)
    assert full.startswith(shown)
    assert full[len(shown) :].splitlines() == [
        "",
        "attempt 1 error:",
        "  " + escaped,
        "  second line",
        "  \\x1b[1mthird\\x1b[0m",
        "",
        "attempt 1 traceback:",
        "  Traceback (most recent call last):",
        '    File "h.py", line 3, in h',
        "  ValueError: \\x1b[5mx",
    ]
    # JSON stays raw JSON: the exact text, escaped by JSON itself
    data = ok_json(
        flowforge("dead", "show", task_id, "--json", url=clean_database_url, config=config)
    )
    assert data["attempts"][0]["error"] == HOSTILE_ERROR


def test_every_table_and_message_escapes_stored_text(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    task_id = dead_with_hostile_error(repo, sql)
    for args in (
        ("dead", "list"),
        ("stats",),
        ("runs",),
        ("status", str(repo.get_task(task_id).run_id)),
    ):
        assert_terminal_safe(ok(flowforge(*args, url=clean_database_url, config=config)))
    # an error message built from what the operator typed is escaped too
    result = flowforge("trigger", "no-such-\x1b[2J-workflow", url=clean_database_url, config=config)
    assert result.returncode == exitcodes.USAGE
    assert_terminal_safe(result.stderr)
    assert "\\x1b[2J" in result.stderr
