"""The container image (Containerfile), built and run for real with podman.

``scripts/image`` builds it once per module (the Debian base from its cache; wheels downloaded on
the host; ``podman build --network none``). Containers run with ``--network host`` against the
session's PostgreSQL and RabbitMQ (private instances under scripts/test and CI), with a config
folder mounted over /etc/flowforge whose URLs point nowhere: ``FLOWFORGE_DATABASE_URL`` and
podman secrets named by ``FLOWFORGE_BROKER_URL_FILE`` / ``FLOWFORGE_API_TOKEN_FILE`` override
them. Every image, container and secret made here has a unique name and is removed; the cached
base image stays.

What is proven: the runtime stage holds no compiler and no pip, runs as uid 10001 with
``flowforge up`` as PID 1, on a read-only root without capabilities; the HEALTHCHECK answers; a
run triggered through the api succeeds, each task executed once; an orphan re-parented to PID 1
is reaped; a SIGKILLed worker is replaced and the tree serves on; ``podman stop`` drains (the
task in flight finishes, exit 0); ``podman kill`` leaves no process, no conmon, no mount behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from flowforge import __version__
from tests.container.podman import (
    Container,
    host_start_time,
    missing_tools,
    podman,
    run_podman,
    ulimit_args,
)
from tests.e2e import DEFAULT_SETTINGS, RECORD_URL_ENV, REPO, Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(900)]

IN_CI = os.environ.get("CI", "").lower() == "true"
TOKEN = "container-test-token"
#: Longer than the config's drain timeout (25 s, the default): the engine's SIGKILL never cuts
#: a drain short. The image format has no field for it, so every run says it.
STOP_TIMEOUT_S = 35
BUILD_TIMEOUT_S = 800.0
READY_S = 90.0
RUN_S = 60.0
WORKFLOW = "container-check"
TASKS = ("a", "b", "c", "d")  # a diamond: a → (b, c) → d


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image built from this checkout under a unique name; removed at the end."""
    missing = missing_tools()
    if missing:
        message = f"container tests need {', '.join(missing)} (scripts/bootstrap installs them)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    tag = f"localhost/flowforge-test-{uuid.uuid4().hex[:10]}:test"
    started = time.monotonic()
    done = subprocess.run(
        [str(REPO / "scripts" / "image"), "--tag", tag],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == tag
    print(f"scripts/image: {time.monotonic() - started:.1f}s")  # shown with -s: the CI budget
    try:
        yield tag
    finally:
        run_podman("rmi", "--force", tag)


@pytest.fixture
def config_dir(stack: Stack, tmp_path: Path) -> Path:
    """A config folder for /etc/flowforge: config.yaml (URLs that reach nothing: the environment
    gives the real ones), the e2e handlers and one workflow. Readable by the image's uid."""
    folder = tmp_path / "etc-flowforge"
    (folder / "workflows").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "e2e_handlers.py", folder / "e2e_handlers.py")
    (api_port,) = free_ports(1)
    settings: dict[str, Any] = {
        **DEFAULT_SETTINGS,
        "database": {"url": "postgresql://nobody@127.0.0.1:1/nowhere"},
        "broker": {"url": "amqp://nobody:x@127.0.0.1:1/%2F", "queue": stack.queue},
        "handlers": ["e2e_handlers"],
        "workflows": ["workflows"],
        "processes": {"workers": 2, "drain_timeout_s": 25},
        "api": {"listen": f"127.0.0.1:{api_port}"},
        "logging": {"format": "json"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(settings))
    tasks: list[dict[str, Any]] = [
        {"name": "a", "handler": "e2e.record"},
        {"name": "b", "handler": "e2e.record", "depends_on": ["a"]},
        {"name": "c", "handler": "e2e.record", "depends_on": ["a"]},
        {"name": "d", "handler": "e2e.record", "depends_on": ["b", "c"]},
    ]
    (folder / "workflows" / "check.yaml").write_text(
        yaml.safe_dump({"name": WORKFLOW, "tasks": tasks})
    )
    sleeper = {"name": "slow", "tasks": [{"name": "nap", "handler": "e2e.sleep"}]}
    (folder / "workflows" / "slow.yaml").write_text(yaml.safe_dump(sleeper))
    for path in [tmp_path, *folder.rglob("*"), folder]:
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    return folder


class Api:
    """The container's api on the host's loopback (``--network host``)."""

    def __init__(self, config_dir: Path) -> None:
        listen = yaml.safe_load((config_dir / "config.yaml").read_text())["api"]["listen"]
        self.base = f"http://{listen}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def trigger(self, workflow: str, run_input: dict[str, Any]) -> str:
        run_id: str = self.call("POST", "/api/v1/runs", {"workflow": workflow, "input": run_input})[
            "id"
        ]
        return run_id

    def wait_succeeded(self, run_id: str) -> None:
        def state() -> bool:
            found = self.call("GET", f"/api/v1/runs/{run_id}")["state"]
            assert found not in ("FAILED", "CANCELLED"), found
            return bool(found == "SUCCEEDED")

        wait_for(state, timeout=RUN_S, interval=0.2, what=f"run {run_id} to succeed")


def start(image: str, config_dir: Path, stack: Stack, started: list[Container]) -> Container:
    """``podman run`` the image's own entrypoint (``flowforge up``) as docs/operations.md shows
    it — the broker URL and the api token as podman secrets named by ``*_FILE`` variables, a
    read-only root, no capability — and wait until the tree is ready. The container (and its
    secrets) go on ``started`` at once, so they are removed whatever happens next."""
    name = f"flowforge-test-{uuid.uuid4().hex[:10]}"
    secrets = {"broker-url": stack.broker_url, "api-token": TOKEN}
    container = Container(name, tuple(f"{name}-{target}" for target in secrets))
    started.append(container)
    secret_args: list[str] = []
    for (target, value), secret in zip(secrets.items(), container.secrets, strict=True):
        source = config_dir.parent / target
        source.write_text(value)
        podman("secret", "create", secret, str(source))
        secret_args += ["--secret", f"{secret},target={target},uid=10001,mode=0400"]
    podman(
        "run", "--detach", "--name", name, "--network", "host",
        "--stop-timeout", str(STOP_TIMEOUT_S),
        # no systemd here to run the HEALTHCHECK on a timer: the test runs it
        "--health-interval", "disable",
        # nothing writable but podman's tmpfs /tmp (and /run/secrets: podman 4.3 cannot mount a
        # secret into a read-only root without a tmpfs there)
        "--read-only", "--tmpfs", "/run/secrets",
        "--cap-drop", "all", "--security-opt", "no-new-privileges",
        *ulimit_args(),
        "--volume", f"{config_dir}:/etc/flowforge:ro",
        *secret_args,
        # the database, overriding the config's; the e2e handlers record their executions
        # through the second (the tree keeps the first from its children)
        "--env", f"FLOWFORGE_DATABASE_URL={stack.database_url}",
        "--env", f"{RECORD_URL_ENV}={stack.database_url}",
        "--env", "FLOWFORGE_BROKER_URL_FILE=/run/secrets/broker-url",
        "--env", "FLOWFORGE_API_TOKEN_FILE=/run/secrets/api-token",
        image,
    )  # fmt: skip
    try:
        wait_for(
            lambda: "tree ready" in container.logs() or container.state()[0] != "running",
            timeout=READY_S,
            interval=0.5,
            what=f"{container.name} to be ready",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its log ends:\n{container.logs()[-4000:]}") from None
    assert container.state()[0] == "running", container.logs()[-4000:]
    return container


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    """Containers a test started: removed at the end (with their secrets), whatever happened."""
    started: list[Container] = []
    yield started
    for container in started:
        container.remove()


def executions(database_url: str, run_id: str) -> list[str]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT task FROM test_executions WHERE run_id = %s ORDER BY task", (run_id,)
        ).fetchall()
    return [row[0] for row in rows]


def test_the_runtime_stage_has_no_compiler_no_pip_and_runs_flowforge_up_unprivileged(
    image: str,
) -> None:
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image))
    assert config["User"] == "10001:10001"
    assert config["StopSignal"] == "SIGTERM"
    assert config["Entrypoint"] == [
        "/usr/bin/env",
        "--block-signal=TERM,INT",
        "/opt/flowforge/bin/flowforge",
    ]
    assert config["Cmd"] == ["up"]
    assert "FLOWFORGE_CONFIG=/etc/flowforge/config.yaml" in config["Env"]
    health = json.loads(podman("image", "inspect", "--format", "{{json .HealthCheck}}", image))
    assert health["Test"] == ["CMD", "/opt/flowforge/bin/python", "-m", "flowforge.healthcheck"]
    probe = (
        "command -v gcc cc c++ make pip pip3; id -u; flowforge --version; python -c 'import"
        ' importlib.util as u; print([m for m in ("pip", "setuptools", "ensurepip")'
        " if u.find_spec(m)])'"
    )
    out = podman(
        "run", "--rm", "--network", "none", *ulimit_args(), "--entrypoint", "/bin/sh", image,
        "-c", probe,
    )  # fmt: skip
    assert out.splitlines() == ["10001", f"flowforge {__version__}", "[]"], out


def test_the_container_serves_replaces_a_killed_worker_reaps_orphans_and_drains_on_stop(
    image: str, config_dir: Path, stack: Stack, containers: list[Container]
) -> None:
    api = Api(config_dir)
    container = start(image, config_dir, stack, containers)
    supervisor = next(p for p in container.top() if p.pid == 1)
    assert supervisor.args.startswith("flowforge: supervisor [config.yaml]"), supervisor
    assert container.healthcheck()

    run_id = api.trigger(WORKFLOW, {"n": 1})
    api.wait_succeeded(run_id)
    assert executions(stack.database_url, run_id) == list(TASKS)

    # an orphan: exec'd processes' children are re-parented to PID 1, which must reap them
    marker = f"orphan-{uuid.uuid4().hex[:8]}"
    podman(
        "exec", "--detach", container.name, "/opt/flowforge/bin/python", "-c",
        "import os, time; os.fork() and os._exit(0); time.sleep(1)", marker,
    )  # fmt: skip
    orphan = wait_for(  # (the exec'd parent itself has ppid 0: its parent is outside)
        lambda: next((p for p in container.top() if marker in p.args and p.ppid == 1), None),
        timeout=10,
        what="the orphan, re-parented to PID 1",
    )
    wait_for(lambda: host_start_time(orphan.hpid) is None, timeout=15, what="the orphan reaped")

    # a worker SIGKILLed from the host is replaced, and the tree serves on
    worker = next(p for p in container.top() if p.args.startswith("flowforge: worker 1/2"))
    os.kill(worker.hpid, signal.SIGKILL)
    wait_for(
        lambda: any(
            p.args.startswith("flowforge: worker 1/2") and p.hpid != worker.hpid
            for p in container.top()
        ),
        timeout=30,
        interval=0.2,
        what="the killed worker to be replaced",
    )
    assert host_start_time(worker.hpid) is None, "the killed worker was not reaped"
    assert not [p for p in container.top() if p.state.startswith("Z")]
    run_id = api.trigger(WORKFLOW, {"n": 2})
    api.wait_succeeded(run_id)
    assert executions(stack.database_url, run_id) == list(TASKS)

    # podman stop: SIGTERM to PID 1, which drains — the task in flight finishes — and exits 0
    slow = api.trigger("slow", {"seconds": 2})
    wait_for(lambda: executions(stack.database_url, slow), timeout=RUN_S, what="the slow task")
    took = container.stop()
    assert container.state() == ("exited", 0), container.logs()[-4000:]
    assert took < STOP_TIMEOUT_S
    lines = container.logs().splitlines()
    messages = [json.loads(line)["msg"] for line in lines if line.startswith("{")]
    assert any(m.startswith("draining (received SIGTERM)") for m in messages)
    assert "all children stopped; exiting with 0" in messages
    assert not [m for m in messages if "killing" in m], "the drain was cut short"
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        (state,) = conn.execute(
            "SELECT state FROM task_runs WHERE run_id = %s", (slow,)
        ).fetchone() or (None,)
    assert state == "SUCCEEDED"
    assert executions(stack.database_url, slow) == ["nap"]


def test_podman_kill_leaves_no_process_no_conmon_and_no_mount_behind(
    image: str, config_dir: Path, stack: Stack, containers: list[Container]
) -> None:
    container = start(image, config_dir, stack, containers)
    container_id = container.container_id()
    procs = {p.hpid: host_start_time(p.hpid) for p in container.top()}
    assert len(procs) == 6  # supervisor, scheduler, 2 workers, publisher, api
    conmon = int(podman("inspect", "--format", "{{.State.ConmonPid}}", container.name))
    assert container_id in Path(f"/proc/{conmon}/cmdline").read_text()

    podman("kill", container.name)  # SIGKILL to PID 1: the kernel ends the whole pid namespace
    assert podman("wait", container.name).strip() == "137"

    def left() -> list[int]:
        return [pid for pid, started in procs.items() if host_start_time(pid) == started]

    wait_for(lambda: not left(), timeout=15, what="every process of the container to be gone")
    # conmon exits once it has recorded the exit; a zombie awaits the host's init, which is not
    # ours to hurry: no conmon is left *running*
    wait_for(lambda: not _running(conmon, container_id), timeout=15, what="conmon to exit")
    podman("rm", container.name)
    assert podman("ps", "--all", "--quiet", "--filter", f"id={container_id}").strip() == ""
    assert container_id not in Path("/proc/self/mountinfo").read_text()


def _running(pid: int, container_id: str) -> bool:
    """Whether ``pid`` is a live process whose command line names the container."""
    try:
        return container_id in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False  # gone (a zombie's command line is empty)
