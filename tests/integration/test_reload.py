"""SIGHUP reloads workflow definitions and handler code in every child of a real tree, under load
(issue 21, SPEC 7.5: "reload under load without a lost or duplicated task").

A ``flowforge up`` tree (two workers, the scheduler, the publisher, the api) takes runs over
HTTP and from the command line the whole time. A task is added to the workflow file and the
handler module changes what it returns; the supervisor gets SIGHUP and replaces the workers,
then the scheduler, then the api. Counted in PostgreSQL afterwards: every run SUCCEEDED, every
task executed exactly once, no HTTP trigger met a refused connection or a 5xx, runs triggered
before the reload kept their digest and their two tasks (some of them finished by the new
code), and runs triggered over HTTP once the reload ended have the new digest, the new task
and the new code's results. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from flowforge.definitions import workflow_from_mapping
from tests import cli_runner
from tests.api_client import TOKEN, TOKEN_ENV, Api
from tests.e2e import REPO, Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real tree

Sql = psycopg.Connection[tuple[Any, ...]]

WORKFLOW = "reload-flow"
TWO = [
    {"name": "a", "handler": "reload.step"},
    {"name": "b", "handler": "reload.step", "depends_on": ["a"]},
]
OLD = {"name": WORKFLOW, "tasks": TWO}
NEW = {
    "name": WORKFLOW,
    "tasks": [*TWO, {"name": "c", "handler": "reload.step", "depends_on": ["b"]}],
}
#: The handler module; the two versions differ in size, so no cached bytecode can pass for
#: the new source.
HANDLERS = """from flowforge import task
from tests.e2e_handlers import record

VERSION = "{version}"


@task("reload.step")
def step(ctx):
    record(ctx, "reload.step")
    return {{"version": VERSION}}
"""
OLD_CODE, NEW_CODE = "old", "new-code"
#: Pace of each trigger loop (seconds): steady load, not a flood of a 2-core machine.
PACE_S = 0.05
ROLL_S = 60.0
SETTLE_S = 60.0
HTTP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Sent:
    """One trigger: how, when it was sent and answered (monotonic), the run it made, or what
    went wrong (a connection error, a status other than 201, an exit code other than 0)."""

    via: str
    sent_at: float
    answered_at: float
    run_id: str | None
    problem: str | None


class Load:
    """Triggers over HTTP and from the command line, each on a thread, until :meth:`stop`."""

    def __init__(self, api: Api, config: Path, env: dict[str, str]) -> None:
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._api, self._config, self._env = api, config, env
        self._threads = [
            threading.Thread(target=self._loop, args=(self._http,), daemon=True),
            threading.Thread(target=self._loop, args=(self._cli,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, one: Callable[[], tuple[str, str | None, str | None]]) -> None:
        while not self._stop.is_set():
            sent_at = time.monotonic()
            via, run_id, problem = one()
            self.sent.append(Sent(via, sent_at, time.monotonic(), run_id, problem))
            self._stop.wait(PACE_S)

    def _http(self) -> tuple[str, str | None, str | None]:
        body = {"workflow": WORKFLOW, "input": {}}
        try:
            reply = self._api.post("/api/v1/runs", body, timeout=HTTP_TIMEOUT_S)
        except OSError as exc:
            return "http", None, f"connection: {exc!r}"
        if reply.status != 201:
            return "http", None, f"{reply.status}: {reply.body[:300]!r}"
        return "http", str(reply.json()["id"]), None

    def _cli(self) -> tuple[str, str | None, str | None]:
        done = cli_runner.run(["-c", str(self._config), "trigger", WORKFLOW], self._env, REPO)
        if done.returncode != 0:
            return "cli", None, f"exit {done.returncode}: {done.stderr.strip()[:300]}"
        return "cli", done.stdout.strip(), None

    def answered(self, via: str, after: float = 0.0) -> list[Sent]:
        return [s for s in list(self.sent) if s.via == via and s.sent_at > after and s.run_id]

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(HTTP_TIMEOUT_S + 60)
            assert not thread.is_alive(), "a trigger loop did not stop"


def write_code(code: Path, flows: Path, workflow: dict[str, Any], version: str) -> None:
    (flows / "reload-flow.yaml").write_text(yaml.safe_dump(workflow))
    (code / "reload_handlers.py").write_text(HANDLERS.format(version=version))


def rows(sql: Sql, query: str, *args: Any) -> list[tuple[Any, ...]]:
    return sql.execute(query, args).fetchall()


def start_tree(
    stack: Stack, tmp_path: Path, trees: list[Tree], workers: int
) -> tuple[Tree, Api, Path, Path]:
    """A ready tree with an api on a free port, running the old workflow and handler code from
    two folders of ``tmp_path``: (tree, api, the code folder, the workflow folder)."""
    code, flows = tmp_path / "code", tmp_path / "workflows"
    code.mkdir()
    flows.mkdir()
    write_code(code, flows, OLD, OLD_CODE)
    port = free_ports(1)[0]
    config = stack.config_path(
        handlers=["reload_handlers"],
        workflows=[str(flows)],
        processes={"workers": workers},
        api={"listen": f"127.0.0.1:{port}", "token_env": TOKEN_ENV},
    )
    paths = [str(code), *filter(None, [os.environ.get("PYTHONPATH")])]  # keep this checkout's
    env = {**stack.env(), TOKEN_ENV: TOKEN, "PYTHONPATH": os.pathsep.join(paths)}
    trees.append(Tree(config, tmp_path / "tree.log", env={**env, "PYTHONDONTWRITEBYTECODE": "1"}))
    trees[-1].ready()
    return trees[-1], Api(port, TOKEN, config), code, flows


def test_sighup_reloads_definitions_and_handler_code_under_load_losing_and_repeating_nothing(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    tree, api, code, flows = start_tree(stack, tmp_path, trees, workers=2)
    config = api.config
    load = Load(api, config, stack.env())
    try:
        wait_for(
            lambda: len(load.answered("http")) >= 5 and len(load.answered("cli")) >= 2,
            60,
            0.05,
            "runs triggered both ways before the reload",
        )
        (old_api,) = re.findall(r"started api \(pid (\d+)\)", tree.log())
        changed_at = time.monotonic()
        write_code(code, flows, NEW, NEW_CODE)
        os.kill(tree.supervisor(), signal.SIGHUP)
        wait_for(lambda: "rolling restart done" in tree.log(), ROLL_S, 0.1, "the reload")
        # the old api accepts until it sees its SIGTERM (within its loop's slice), then
        # serves what it took: the reload is over for a client once it is gone
        gone = f"api-1 (pid {old_api}) stopped"
        wait_for(lambda: gone in tree.log(), ROLL_S, 0.05, "the old api to stop")
        done_at = time.monotonic()
        wait_for(lambda: len(load.answered("http", done_at)) >= 5, 60, 0.05, "runs after it")
    finally:
        load.stop()
    log = tree.log()
    assert "rolling restart done: 4 child(ren) replaced" in log, log[-3000:]
    assert "reload_failed" not in log and "reload stopped" not in log

    problems = [s for s in load.sent if s.problem]
    assert not problems, problems[:5]  # no refused connection, no 5xx, no failed command
    during = [s for s in load.sent if s.via == "http" and changed_at < s.sent_at < done_at]
    assert len(during) >= 10, "the api was not under load while it was replaced"
    made = {s.run_id for s in load.sent}

    def settled() -> bool:
        open_runs = rows(sql, "SELECT count(*) FROM workflow_runs WHERE finished_at IS NULL")
        return open_runs[0][0] == 0

    wait_for(settled, SETTLE_S, 0.2, "every run to finish")
    runs = {
        str(run_id): (state, digest)
        for run_id, state, digest in rows(
            sql, "SELECT id, state, workflow_digest FROM workflow_runs"
        )
    }
    assert set(runs) == made
    assert {state for state, _ in runs.values()} == {"SUCCEEDED"}
    # exactly one execution per task, counted by the handler itself
    executions = rows(
        sql,
        "SELECT t.id, count(e.id) FROM task_runs t"
        " LEFT JOIN test_executions e ON e.task_run_id = t.id GROUP BY t.id",
    )
    assert executions and {n for _, n in executions} == {1}, sorted({n for _, n in executions})
    assert rows(sql, "SELECT count(*) FROM test_executions")[0][0] == len(executions)

    old, new = workflow_from_mapping(OLD).digest, workflow_from_mapping(NEW).digest
    tasks: dict[str, dict[str, str]] = {}
    for run_id, name, result in rows(sql, "SELECT run_id, name, result FROM task_runs"):
        value = result if isinstance(result, dict) else json.loads(result)
        tasks.setdefault(str(run_id), {})[name] = value["version"]
    for run_id, (_, digest) in runs.items():  # each run ran the graph it was triggered with
        assert sorted(tasks[run_id]) == (["a", "b"] if digest == old else ["a", "b", "c"])
    # the api serves the definitions it loaded until it is replaced (a command started just
    # before the change may read the new file: it reads them each time)
    before = [s.run_id for s in load.answered("http") if s.sent_at < changed_at]
    assert before and {runs[r][1] for r in before if r} == {old}
    crossed = [r for r, (_, d) in runs.items() if d == old and NEW_CODE in tasks[r].values()]
    assert crossed, "no run of the old definition was finished by the new code"
    after = [s.run_id for s in load.answered("http", done_at)]
    assert {runs[r][1] for r in after if r} == {new}
    assert {v for r in after if r for v in tasks[r].values()} == {NEW_CODE}
    cli_after = [s.run_id for s in load.answered("cli", changed_at)]
    assert {runs[r][1] for r in cli_after if r} <= {new}  # the command reads the files each time


def test_a_reload_whose_new_code_does_not_load_stops_there_and_the_tree_serves_on(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    """Failure mode 99 with real processes: the new worker cannot import its handlers and
    exits before it is ready; the reload stops, the tree keeps running on the old code, and
    the next SIGHUP, once the file is fixed, reloads."""
    tree, api, code, flows = start_tree(stack, tmp_path, trees, workers=1)

    def versions_of_a_new_run() -> set[str]:
        reply = api.post("/api/v1/runs", {"workflow": WORKFLOW, "input": {}})
        assert reply.status == 201, (reply.status, reply.body[:300])
        run_id = reply.json()["id"]

        def results() -> set[str] | None:
            found = rows(
                sql,
                "SELECT t.result ->> 'version' FROM task_runs t JOIN workflow_runs r"
                " ON r.id = t.run_id WHERE r.id = %s AND r.state = 'SUCCEEDED'",
                run_id,
            )
            return {v for (v,) in found} or None

        return wait_for(results, SETTLE_S, 0.1, "the run to succeed")

    (code / "reload_handlers.py").write_text("def broken(:\n")
    os.kill(tree.supervisor(), signal.SIGHUP)
    wait_for(lambda: "reload stopped" in tree.log(), ROLL_S, 0.1, "the reload to stop")
    assert tree.proc.poll() is None, tree.log()[-3000:]
    assert "2 more child(ren) not replaced" in tree.log()  # the scheduler and the api
    assert versions_of_a_new_run() == {OLD_CODE}  # the old worker and api serve on

    write_code(code, flows, OLD, NEW_CODE)
    os.kill(tree.supervisor(), signal.SIGHUP)
    wait_for(lambda: "rolling restart done: 3" in tree.log(), ROLL_S, 0.1, "the next reload")
    assert versions_of_a_new_run() == {NEW_CODE}
    assert "draining" not in tree.log() and "stopping the tree" not in tree.log()
