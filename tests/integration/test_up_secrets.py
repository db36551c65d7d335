"""``flowforge up`` prints and logs no secret, whatever URL shape carries it, and a tree whose
secrets are only in files shows them nowhere.

First, a real tree (scheduler, publisher, a worker, the api) runs on a config whose database URL
holds a userinfo password and ``sslpassword=`` / ``password=`` parameters and whose broker list
holds a node with a password that cannot be reached (so connection failures get logged too),
at log level DEBUG. Its banner and every log line until it is ready and stopped are read.

Then a tree whose database password, broker password and api token exist only in files (named
by ``*_FILE`` variables and ``*_file`` keys) runs against a private PostgreSQL and RabbitMQ that
demand those passwords, and serves a run through the api with that token: so the files were
read and used. Every process's command line (its title), environment and ``ps`` line, every log
line at DEBUG, the banner, the CLI's output and the api's answers are searched for each secret.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from tests.e2e import Stack
from tests.harness.resources import child_pids, free_ports
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2"
READY_S = 60.0
STOP_S = 30.0
RUN_S = 60.0
HTTP_S = 10.0


def test_up_prints_and_logs_no_secret(stack: Stack, tmp_path: Path) -> None:
    db = conninfo_to_dict(stack.database_url)
    database_url = (
        f"postgresql://{db.get('user', 'postgres')}:{SECRET}@{db.get('host', '127.0.0.1')}:"
        f"{db.get('port', 5432)}/{db['dbname']}?sslpassword={SECRET}&application_name=ff"
    )
    dead_port, api_port = free_ports(2)
    config = tmp_path / "up.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "database": {"url": database_url},
                "broker": {
                    "url": [f"amqp://ff:{SECRET}@127.0.0.1:{dead_port}/%2F", stack.broker_url],
                    "queue": stack.queue,
                },
                "processes": {"workers": 1},
                "api": {"listen": f"127.0.0.1:{api_port}"},
                "logging": {"level": "DEBUG"},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        tree = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        wait_for(lambda: "tree ready" in err.read_text(), READY_S, 0.1, "the tree to be ready")
    finally:
        code = stop_tree(tree)
    banner, logs = out.read_text(), err.read_text()
    assert code == 0, logs[-3000:]
    assert f":***@127.0.0.1:{dead_port}/%2F" in banner
    assert ":***@" in banner.splitlines()[1] and "sslpassword=***" in banner
    assert "tree ready" in logs and len(logs.splitlines()) > 20  # there was much to read
    assert SECRET not in banner
    assert SECRET not in logs, [line for line in logs.splitlines() if SECRET in line]


# ------------------------------------------------------------------ secrets only in files

#: Each secret is made of letters, digits and "-": percent-encoding leaves it as it is, so a
#: leak of its encoded form (in a URL) is found by the same search.
DB_SECRET = f"db-{uuid.uuid4().hex}"
MQ_SECRET = f"mq-{uuid.uuid4().hex}"
API_TOKEN = f"tok-{uuid.uuid4().hex}"
SECRETS = (DB_SECRET, MQ_SECRET, API_TOKEN)
#: The api pages and endpoints read after the run (``{run}``: its id, ``{task}``: its task's).
API_PATHS = (
    "/api/v1/task-runs/{task}",
    "/health/live",
    "/health/ready",
    "/metrics",
    "/api/v1/runs",
    "/api/v1/runs/{run}",
    "/api/v1/overview",
    "/api/v1/processes",
    "/api/v1/dead",
    "/ui",
    "/ui/runs",
    "/ui/runs/{run}",
    "/ui/processes",
)
HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@dataclass
class PasswordServices:
    """A private PostgreSQL where role ``ff`` must give :data:`DB_SECRET`, and a private
    RabbitMQ where user ``ff`` must give :data:`MQ_SECRET`."""

    pg_port: int
    amqp_port: int


@pytest.fixture(scope="module")
def password_services() -> Iterator[PasswordServices]:
    from tests.harness.services import PrivatePostgres, PrivateRabbitMQ, ServiceUnavailable

    base_dir = Path(tempfile.mkdtemp(prefix="ff-secrets-"))
    base_dir.chmod(0o755)  # the service accounts must traverse it
    hba = base_dir / "pg_hba.conf"
    hba.write_text(HBA)
    hba.chmod(0o644)
    pg_port, amqp_port, dist_port, epmd_port = free_ports(4)
    pg = PrivatePostgres(base_dir, pg_port, extra_settings=[f"hba_file = '{hba}'"])
    rabbit = PrivateRabbitMQ(
        base_dir, amqp_port, dist_port, f"ff-secrets-{os.getpid()}", epmd_port=epmd_port
    )
    try:
        try:
            pg.start()
            rabbit.start()
        except ServiceUnavailable as exc:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"required service missing in CI: {exc}")
            pytest.skip(str(exc))
        with psycopg.connect(pg.admin_url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE ff LOGIN PASSWORD '{DB_SECRET}'")
            admin.execute("ALTER DATABASE flowforge OWNER TO ff")
        rabbit.rabbitmqctl("add_user", "ff", MQ_SECRET)
        rabbit.rabbitmqctl("set_permissions", "-p", "/", "ff", ".*", ".*", ".*")
        yield PasswordServices(pg_port, amqp_port)
    finally:
        try:
            rabbit.stop()
        finally:
            pg.stop()
            shutil.rmtree(base_dir, ignore_errors=True)


def request(
    port: int, method: str, path: str, token: str | None = API_TOKEN, body: Any = None
) -> tuple[int, str, str]:
    """``(status, headers, body)`` of one request to the api on ``port``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_S)
    try:
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, str(response.headers), response.read().decode()
    finally:
        conn.close()


def process_views(pid: int) -> dict[str, str]:
    """What anyone on the machine can learn of process ``pid``: its command line (where
    setproctitle writes the title), its name, its environment (same user or root) and its line
    in ``ps``."""
    proc = Path(f"/proc/{pid}")
    ps = subprocess.run(
        ["ps", "-ww", "-o", "pid=,comm=,args=", "-p", str(pid)],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return {
        "cmdline": proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(),
        "status": proc.joinpath("status").read_text(),
        "environ": proc.joinpath("environ").read_bytes().replace(b"\0", b"\n").decode(),
        "ps": ps.stdout,
    }


def assert_no_secret(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (where, [line for line in text.splitlines() if secret in line])


@pytest.mark.slow  # a private PostgreSQL and RabbitMQ that demand passwords: ~45 s in all
def test_a_tree_whose_secrets_are_only_in_files_shows_them_nowhere(
    password_services: PasswordServices, tmp_path: Path
) -> None:
    services = password_services
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name, text, mode in [
        ("db-password", DB_SECRET + "\n", 0o600),
        ("mq-password", MQ_SECRET, 0o400),
        ("api-token", API_TOKEN + "\n", 0o644),  # too open: used, with a warning
    ]:
        secrets.joinpath(name).write_text(text)
        secrets.joinpath(name).chmod(mode)
    dead_port, api_port = free_ports(2)
    # the broker nodes (a user, no password) come from a file too; one node is unreachable,
    # so the processes that start there log a connection failure for that URL
    secrets.joinpath("broker-urls").write_text(
        f"amqp://ff@127.0.0.1:{dead_port}/%2F\namqp://ff@127.0.0.1:{services.amqp_port}/%2F\n"
    )
    workflows = tmp_path / "workflows"
    workflows.mkdir()
    workflows.joinpath("secret-probe.yaml").write_text(
        "name: secret-probe\ntasks:\n  - name: only\n    handler: secrets.environ\n"
    )
    # a worker's environment, as its handlers see it, becomes the task's result (setproctitle
    # reuses the memory /proc/PID/environ shows, so that file alone cannot tell)
    tmp_path.joinpath("secret_probe.py").write_text(
        "import os\nfrom flowforge import task\n\n\n"
        '@task("secrets.environ")\ndef environ(ctx):\n    return {"environ": dict(os.environ)}\n'
    )
    config = tmp_path / "up.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "database": {"url": f"postgresql://ff@127.0.0.1:{services.pg_port}/flowforge"},
                "broker": {
                    "url_file": "secrets/broker-urls",  # relative: under the config's folder
                    "password_file": "secrets/mq-password",
                    "queue": f"ff-secrets-{uuid.uuid4().hex[:8]}",
                },
                "handlers": ["secret_probe"],  # imported from the config's folder
                "workflows": [str(workflows)],
                "processes": {"workers": 1},
                "api": {"listen": f"127.0.0.1:{api_port}"},
                "logging": {"level": "DEBUG"},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}
    env["FLOWFORGE_DATABASE_PASSWORD_FILE"] = str(secrets / "db-password")
    env["FLOWFORGE_API_TOKEN_FILE"] = str(secrets / "api-token")
    assert_no_secret("the config file", config.read_text())
    assert_no_secret("the environment", "\n".join(f"{k}={v}" for k, v in env.items()))

    def flowforge(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flowforge.cli", "-vv", "-c", str(config), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    migrated = flowforge("migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    shown = [("migrate", migrated.stdout + migrated.stderr)]

    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        tree = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        wait_for(lambda: "tree ready" in err.read_text(), READY_S, 0.1, "the tree to be ready")
        pids = [tree.pid, *child_pids(tree.pid, recursive=True)]
        views = {pid: process_views(pid) for pid in pids}

        # the token from its file is the api's: a wrong one is refused, the right one triggers
        assert request(api_port, "POST", "/api/v1/runs", "wrong", {})[0] == 403
        status, _, body = request(
            api_port, "POST", "/api/v1/runs", body={"workflow": "secret-probe", "input": {}}
        )
        assert status == 201, body
        run, task = json.loads(body)["id"], json.loads(body)["tasks"][0]["id"]

        # the run succeeds: the workers reached the database and the broker with their passwords
        def succeeded() -> bool:
            answer = request(api_port, "GET", f"/api/v1/runs/{run}")
            return answer[0] == 200 and json.loads(answer[2])["state"] == "SUCCEEDED"

        wait_for(succeeded, RUN_S, 0.2, "the run to succeed")
        answers = {
            path: request(api_port, "GET", path.format(run=run, task=task)) for path in API_PATHS
        }
        for cli in (("status", run), ("runs", "--json"), ("ps",)):
            done = flowforge(*cli)
            assert done.returncode == 0, done.stderr[-3000:]
            shown.append((" ".join(cli), done.stdout + done.stderr))
    finally:
        code = stop_tree(tree)
    banner, logs = out.read_text(), err.read_text()
    assert code == 0, logs[-3000:]

    # the searches below read something: five processes with their titles, answers, lines
    assert len(pids) == 5, views
    titles = sorted(v["cmdline"].strip() for v in views.values())
    assert titles == [
        "flowforge: api",
        "flowforge: publisher",
        "flowforge: scheduler",
        "flowforge: supervisor [up.yaml]",
        "flowforge: worker 1/1",
    ]
    worker_env = json.loads(answers["/api/v1/task-runs/{task}"][2])["result"]["environ"]
    assert worker_env["FLOWFORGE_API_TOKEN_FILE"] == str(secrets / "api-token")
    for path, (status, _, _) in answers.items():
        assert status == 200, (path, status)
    assert "tree ready" in logs and len(logs.splitlines()) > 20
    assert "password=***" in banner and f"amqp://ff:***@127.0.0.1:{dead_port}/%2F" in banner
    warning = (
        f"FLOWFORGE_API_TOKEN_FILE: secret file {secrets / 'api-token'} is readable by group"
        " or others (mode 0644)"
    )
    assert [line for line in logs.splitlines() if " WARNING " in line and warning in line]

    # ... and none of it holds a secret
    for pid, view in views.items():
        for kind, text in view.items():
            assert_no_secret(f"{kind} of pid {pid}", text)
    for path, (_, headers, body) in answers.items():
        assert_no_secret(path, headers + body)
    for command, text in shown:
        assert_no_secret(f"flowforge {command}", text)
    assert_no_secret("the banner", banner)
    assert_no_secret("the log", logs)


# ------------------------------------------------------------------ secrets in variables


def test_secrets_given_in_variables_are_dropped_before_any_child_starts(
    stack: Stack, tmp_path: Path
) -> None:
    """The database URL (with a password), the broker URL and the api token given as variables
    reach the tree, which uses them, and nothing it forks: no child's environment, no handler's
    ``os.environ`` (so no program a handler starts) holds them."""
    db = conninfo_to_dict(stack.database_url)
    database_url = (  # the test server trusts 127.0.0.1: the password is carried, not checked
        f"postgresql://{db.get('user', 'postgres')}:{DB_SECRET}@{db.get('host', '127.0.0.1')}:"
        f"{db.get('port', 5432)}/{db['dbname']}"
    )
    broker_url = stack.broker_url
    workflows = tmp_path / "workflows"
    workflows.mkdir()
    workflows.joinpath("secret-probe.yaml").write_text(
        "name: secret-probe\ntasks:\n  - name: only\n    handler: secrets.environ\n"
    )
    tmp_path.joinpath("secret_probe.py").write_text(
        "import os\nfrom flowforge import task\n\n\n"
        '@task("secrets.environ")\ndef environ(ctx):\n    return {"environ": dict(os.environ)}\n'
    )
    (api_port,) = free_ports(1)
    config = tmp_path / "up.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "broker": {"queue": stack.queue},
                "handlers": ["secret_probe"],
                "workflows": [str(workflows)],
                "processes": {"workers": 1},
                "api": {"listen": f"127.0.0.1:{api_port}"},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}
    env |= {
        "FLOWFORGE_DATABASE_URL": database_url,
        "FLOWFORGE_BROKER_URL": broker_url,
        "FLOWFORGE_API_TOKEN": API_TOKEN,
    }
    err = tmp_path / "stderr"
    with err.open("wb") as stderr:
        tree = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        wait_for(lambda: "tree ready" in err.read_text(), READY_S, 0.1, "the tree to be ready")
        pids = [tree.pid, *child_pids(tree.pid, recursive=True)]
        views = {pid: process_views(pid) for pid in pids}
        status, _, body = request(
            api_port, "POST", "/api/v1/runs", body={"workflow": "secret-probe", "input": {}}
        )
        assert status == 201, body  # the token from the variable is the api's
        run, task = json.loads(body)["id"], json.loads(body)["tasks"][0]["id"]

        def result() -> Any:
            answer = request(api_port, "GET", f"/api/v1/task-runs/{task}")
            found = json.loads(answer[2]) if answer[0] == 200 else {"task": {}}
            return found["result"] if found["task"].get("state") == "SUCCEEDED" else None

        worker_env = wait_for(result, RUN_S, 0.2, f"run {run} to succeed")["environ"]
    finally:
        code = stop_tree(tree)
    assert code == 0, err.read_text()[-3000:]
    assert len(views) == 5, views  # the supervisor, scheduler, publisher, a worker, the api
    for name in ("FLOWFORGE_DATABASE_URL", "FLOWFORGE_BROKER_URL", "FLOWFORGE_API_TOKEN"):
        assert name not in worker_env, name
    assert worker_env.get("PATH") == env["PATH"]  # the rest of the environment is inherited
    assert_no_secret("a handler's os.environ", json.dumps(worker_env))
    for pid, view in views.items():
        assert_no_secret(f"environ of pid {pid}", view["environ"])


def stop_tree(tree: subprocess.Popen[bytes]) -> int:
    """SIGTERM the tree and return its exit status; one that has not stopped in STOP_S is
    SIGKILLed before the failure is raised, so no tree outlives its test."""
    tree.send_signal(signal.SIGTERM)
    try:
        return tree.wait(STOP_S)
    except subprocess.TimeoutExpired:
        tree.kill()
        tree.wait(STOP_S)
        raise
