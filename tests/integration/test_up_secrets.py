"""``flowforge up`` prints and logs no secret, whatever URL shape carries it.

A real tree (scheduler, publisher, a worker, the api) runs on a config whose database URL
holds a userinfo password and ``sslpassword=`` / ``password=`` parameters and whose broker list
holds a node with a password that cannot be reached (so connection failures get logged too),
at log level DEBUG. Its banner and every log line until it is ready and stopped are read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from tests.e2e import Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2"
READY_S = 60.0
STOP_S = 30.0


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
        tree.send_signal(signal.SIGTERM)
        code = tree.wait(STOP_S)
    banner, logs = out.read_text(), err.read_text()
    assert code == 0, logs[-3000:]
    assert f":***@127.0.0.1:{dead_port}/%2F" in banner
    assert ":***@" in banner.splitlines()[1] and "sslpassword=***" in banner
    assert "tree ready" in logs and len(logs.splitlines()) > 20  # there was much to read
    assert SECRET not in banner
    assert SECRET not in logs, [line for line in logs.splitlines() if SECRET in line]
