"""The opt-in pytest plugin ``flowforge.testing.pytest`` as a user runs it: a project of its
own (conftest, config, handlers, a workflow file, tests) in a fresh directory, its own pytest
process, a real tree on the shared PostgreSQL and RabbitMQ. The user's tests trigger runs and
wait for them; afterwards the tree (supervisor and children) is gone and the session's scratch
database is dropped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import psycopg
import pytest

from tests.harness.bench_outbox import delete_queues
from tests.harness.resources import child_pids
from tests.trees import alive

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

HANDLERS = """
from flowforge import PermanentError, task


@task("demo.double")
def double(ctx):
    return {"doubled": ctx.input["n"] * 2}


@task("demo.report")
def report(ctx):
    return {"report": ctx.upstream["double"]["doubled"] + 1}


@task("demo.refuse")
def refuse(ctx):
    raise PermanentError("refused")
"""

WORKFLOWS = """
name: demo
tasks:
  - {name: double, handler: demo.double}
  - {name: report, handler: demo.report, depends_on: [double]}
"""

USER_TESTS = """
import os
from pathlib import Path

from flowforge import RunState, TaskState, WorkflowDef, TaskDef


def test_a_run_succeeds_on_the_real_tree(flowforge_tree, flowforge_client):
    Path(os.environ["PROBE"]).write_text(
        f"{flowforge_tree.pid} {flowforge_tree.config.database.url}"
    )
    run = flowforge_client.trigger("demo", {"n": 20})
    done = flowforge_client.wait(run.run_id, timeout=60)
    assert done.state is RunState.SUCCEEDED
    assert done.task("report").result == {"report": 41}
    # executed once each, as the database's attempts say
    for task in done.tasks:
        assert len(flowforge_client.attempts(task.id)) == 1


def test_a_failure_is_seen_as_failed(flowforge_client):
    refusing = WorkflowDef("refusing", (TaskDef("only", "demo.refuse"),))
    from flowforge.client import Client

    with Client(flowforge_client.config, workflows=[refusing]) as client:
        run = client.trigger("refusing", {})
        done = client.wait(run.run_id, timeout=60)
    assert done.state is RunState.FAILED
    assert done.task("only").state is TaskState.DEAD
    assert done.task("only").failure_reason == "permanent_error"
"""


@pytest.fixture
def project(tmp_path: Path, pg_server_url: str, broker_url: str) -> Iterator[Path]:
    """A user's project whose tree uses a queue of its own (deleted afterwards)."""
    queue = f"flowforge.plugin.{uuid.uuid4().hex[:10]}"
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["flowforge.testing.pytest"]\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nflowforge_config = flowforge.yaml\n")
    (tmp_path / "demo_handlers.py").write_text(HANDLERS)
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "demo.yaml").write_text(WORKFLOWS)
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "flowforge.yaml").write_text(
        textwrap.dedent(
            f"""
            database: {{url: "{pg_server_url}"}}
            broker: {{url: "{broker_url}", queue: {queue}}}
            handlers: [demo_handlers]
            workflows: [workflows]
            processes: {{workers: 1, drain_timeout_s: 10}}
            scheduler: {{poll_interval_s: 0.2}}
            """
        )
    )
    yield tmp_path
    with contextlib.suppress(pika.exceptions.AMQPError):
        delete_queues(broker_url, queue)


def _python(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the user's project, with this checkout's flowforge as if installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(REPO)
    env["PROBE"] = str(project / "probe.txt")
    return subprocess.run(
        [sys.executable, *args], cwd=project, env=env, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip


def _user_pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _python(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args)


@pytest.mark.slow
def test_the_fixture_runs_a_real_tree_and_leaves_nothing_behind(
    project: Path, pg_server_url: str
) -> None:
    done = _user_pytest(project)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
    pid_text, database_url = (project / "probe.txt").read_text().split(" ", 1)
    supervisor = int(pid_text)
    assert not alive(supervisor) and child_pids(supervisor) == []
    name = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    assert str(name).startswith("flowforge_test_")
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        left = admin.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,))
        assert left.fetchone() == (0,)


def test_without_a_config_the_fixture_says_how_to_name_one(project: Path) -> None:
    (project / "pytest.ini").write_text("[pytest]\n")
    done = _user_pytest(project, "-k", "failure_is_seen")
    assert done.returncode != 0
    assert "flowforge_tree needs a config: --flowforge-config PATH" in done.stdout
    assert not (project / "probe.txt").exists()


KILLED_SESSION = """
import os, signal, sys
from flowforge.testing.tree import TestTree

tree = TestTree(sys.argv[1], sys.argv[2], database_url=sys.argv[3])
tree.start()
print(tree.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a CI timeout, say: no teardown runs
"""


@pytest.mark.slow
def test_a_tree_whose_test_process_is_killed_drains_and_exits(
    project: Path, pg_server_url: str
) -> None:
    from flowforge.testing.tree import drop_database, scratch_database
    from tests.helpers import wait_for

    database = scratch_database(pg_server_url)
    try:
        done = _python(project, "-c", KILLED_SESSION, "flowforge.yaml", "tree.log", database)
        assert done.returncode == -9, done.stderr[-3000:]
        supervisor = int(done.stdout)
        children = child_pids(supervisor, recursive=True)
        assert children  # the tree was running when its starter died
        wait_for(
            lambda: not any(alive(p) for p in [supervisor, *children]),
            timeout=30,
            what="the orphaned tree to drain and exit",
        )
        log = (project / "tree.log").read_text()
        assert "draining (" in log and "all children stopped; exiting with 0" in log
    finally:
        drop_database(database)


@pytest.mark.slow
def test_a_tree_that_cannot_boot_fails_start_with_its_log_and_is_not_left_running(
    tmp_path: Path, database_url: str, broker_url: str
) -> None:
    from flowforge.testing.tree import TestTree, TreeError

    config = tmp_path / "broken.yaml"
    config.write_text(
        f'database: {{url: "{database_url}"}}\n'
        f'broker: {{url: "{broker_url}", queue: flowforge.plugin.broken}}\n'
        "handlers: [no_such_handlers_module]\n"
        "workflows: []\n"
        "processes: {workers: 1}\n"
    )
    tree = TestTree(config, tmp_path / "tree.log", env={"PYTHONPATH": str(REPO)}, cwd=tmp_path)
    with pytest.raises(TreeError) as raised:
        tree.start(ready_timeout_s=60)
    assert "the tree exited with" in str(raised.value)
    assert "no_such_handlers_module" in str(raised.value)  # the log's tail says why
    assert tree.proc is not None and tree.proc.poll() is not None
    assert tree.stop() == tree.proc.returncode  # stopping a stopped tree is a no-op
