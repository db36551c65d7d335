"""``flowforge dev`` for real: private PostgreSQL and RabbitMQ on free ports, the tree, a reload
when the handler file changes, a broken save that does not reach the workers (failure mode 98),
and a SIGTERM after which nothing it started is left. Slow: a RabbitMQ boots (about 10 s)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from flowforge.devservices.procs import all_pids, pid_alive, port_in_use, proc_cwd
from flowforge.devservices.project import Ports, ProjectServices
from flowforge.errors import DevServiceMissingError
from tests.harness.resources import choose_ports, free_ports
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

HANDLER = """from flowforge import task


@task("devit.version")
def version(ctx):
    return {"version": VERSION}
"""
START_TIMEOUT_S = 180.0  # a first RabbitMQ boot on a busy 2-core machine
STOP_TIMEOUT_S = 120.0


@dataclass
class Project:
    folder: Path
    config: Path
    handler: Path
    ports: Ports
    api_port: int
    log: Path

    @property
    def state_dir(self) -> Path:
        return self.folder / ".flowforge-dev"

    def services(self) -> ProjectServices:
        return ProjectServices(self.state_dir, self.ports)

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def write_handler(self, body: str) -> None:
        before = self.handler.stat().st_mtime_ns
        self.handler.write_text(body)
        # a coarse filesystem clock could keep the time: move it on, as a later save would
        os.utime(self.handler, ns=(before + 1_000_000_000, before + 1_000_000_000))

    def cli(self, *args: str) -> str:
        env = {
            **os.environ,
            "FLOWFORGE_DATABASE_URL": self.services().database_url,
            "FLOWFORGE_BROKER_URL": self.services().broker_url,
        }
        argv = [sys.executable, "-m", "flowforge.cli", "-c", str(self.config), *args]
        return subprocess.run(
            argv, env=env, capture_output=True, text=True, check=True, timeout=60
        ).stdout


def _dist_ports() -> int:
    """A free distribution port whose neighbour (the private epmd's) is free too."""
    for port in free_ports(10):
        try:
            choose_ports(1, [port + 1])
        except RuntimeError:
            continue
        return port
    raise RuntimeError("no free pair of ports for Erlang distribution and epmd")


@pytest.fixture
def project() -> Iterator[Project]:
    folder = Path(tempfile.mkdtemp(prefix="ff-dev-"))
    folder.chmod(0o755)  # the service accounts must traverse it
    pg_port, amqp_port, api_port = free_ports(3)
    ports = Ports(pg_port, amqp_port, _dist_ports())
    (folder / "workflows").mkdir()
    (folder / "workflows" / "devit.yaml").write_text(
        "name: devit\ntasks:\n  - {name: v, handler: devit.version}\n"
    )
    handler = folder / "devit_handlers.py"
    handler.write_text(HANDLER.replace("VERSION", "1"))
    config = folder / "flowforge.yaml"
    config.write_text(
        "database: {url: 'postgresql://127.0.0.1:1/never'}\n"  # dev runs its own
        "broker: {url: 'amqp://guest:guest@127.0.0.1:1/%2F', queue: devit}\n"
        "handlers: [devit_handlers]\nworkflows: [workflows]\n"
        f"processes: {{workers: 1}}\napi: {{listen: '127.0.0.1:{api_port}'}}\n"
    )
    made = Project(folder, config, handler, ports, api_port, folder / "dev.log")
    try:
        made.services().check_installed()
    except DevServiceMissingError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"required service missing in CI: {exc}")
        pytest.skip(str(exc))
    try:
        yield made
    finally:
        for failure in made.services().stop():  # only if the test failed before dev stopped them
            print(failure)
        shutil.rmtree(folder, ignore_errors=True)


def _start_dev(project: Project) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "flowforge.cli", "dev", "-c", str(project.config),
        "--pg-port", str(project.ports.pg), "--amqp-port", str(project.ports.amqp),
        "--dist-port", str(project.ports.dist), "--interval", "0.2",
    ]  # fmt: skip
    with project.log.open("wb") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def _run_result(project: Project) -> tuple[dict[str, int], int]:
    """Trigger a run of ``devit``; once it succeeded: its result and its executions."""
    run_id = project.cli("trigger", "devit").strip()
    query = (
        "SELECT t.result, (SELECT count(*) FROM task_attempts a WHERE a.task_run_id = t.id) "
        "FROM task_runs t WHERE t.run_id = %s AND t.state = 'SUCCEEDED'"
    )

    def finished() -> tuple[dict[str, int], int] | None:
        with psycopg.connect(project.services().database_url) as conn:
            row = conn.execute(query, (run_id,)).fetchone()
        return (row[0], row[1]) if row else None

    return wait_for(finished, timeout=60, interval=0.2, what=f"run {run_id} to succeed")


def _after(project: Project, marker: str, then: str, timeout: float = 60) -> None:
    """Wait until ``then`` appears in dev's output after the last ``marker``."""

    def seen() -> bool:
        said = project.said()
        return marker in said and then in said[said.rindex(marker) :]

    wait_for(seen, timeout=timeout, interval=0.2, what=f"{then!r} after {marker!r}")


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for pid in all_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat.rpartition(")")[2].split()[1])
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        children = {p for p, pp in parents.items() if pp == parent}
        found |= children
        todo.extend(children)
    return found


def test_dev_runs_the_tree_reloads_a_changed_handler_keeps_a_broken_one_out_and_stops_all(
    project: Project,
) -> None:
    dev = _start_dev(project)
    try:
        wait_for(
            lambda: "tree ready" in project.said() or dev.poll() is not None,
            timeout=START_TIMEOUT_S,
            interval=0.5,
            what="the dev tree to be ready",
        )
        said = project.said()
        assert dev.poll() is None, said
        assert f"dashboard http://127.0.0.1:{project.api_port}/ui/" in said
        assert "api token (made for dev" in said
        assert _run_result(project) == ({"version": 1}, 1)

        project.write_handler(HANDLER.replace("VERSION", "2"))
        # the rolling restart is over once the old worker stopped
        _after(project, "reload 1: devit_handlers.py changed", "stopped: exited with code 0")
        assert _run_result(project) == ({"version": 2}, 1)

        project.write_handler(HANDLER.replace("VERSION", "3") + "def broken(:\n")
        wait_for(lambda: "not reloaded (devit_handlers.py)" in project.said(), timeout=60)
        assert "SyntaxError" in project.said()
        assert "reload 2" not in project.said()
        assert _run_result(project) == ({"version": 2}, 1)  # the workers kept their code

        services = project.services()
        started = _descendants(dev.pid) | set(services.pids())
        epmd = (services.rabbitmq.root / "epmd.pid").read_text().strip()
        started.add(int(epmd))
        assert len(started) >= 8  # supervisor, 4 children, postmaster (+ backends), beam, epmd
    finally:
        dev.send_signal(signal.SIGTERM)
        code = dev.wait(timeout=STOP_TIMEOUT_S)
    said = project.said()
    assert code == 0, said
    assert "stopping PostgreSQL and RabbitMQ" in said and "could not stop" not in said
    assert [p for p in started if pid_alive(p)] == []
    assert [
        p for p in all_pids() if (proc_cwd(p) or Path("/")).is_relative_to(project.folder)
    ] == []
    assert [p for p in project.ports.all() if port_in_use(p)] == []
    assert not port_in_use(project.api_port)
