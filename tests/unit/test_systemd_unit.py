"""The shipped systemd unit (deploy/systemd/flowforge.service) holds to what the code does.

Its settings are read and checked against the code they depend on: the drain timeout it must
outlast, the exit codes that mean "do not restart", the signal a reload sends, the variables
the secrets are read from. ``systemd-analyze verify`` checks that systemd itself accepts every
line (it warns, and still exits 0, on a line it ignores: so its output must be empty).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from flowforge.config import ENV_BROKER_URL, ENV_DATABASE_URL, ProcessesConfig
from supervisor import exitcodes
from supervisor.tree import HANDLED_SIGNALS, TICK_S
from tests.conftest import IN_CI

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "flowforge.service"
SYSUSERS = REPO / "deploy" / "systemd" / "flowforge.sysusers"
#: What TimeoutStopSec must leave beyond the drain: the last reap and the exit.
STOP_MARGIN_S = 10.0

Unit = dict[str, dict[str, list[str]]]


def read_unit(path: Path = UNIT) -> Unit:
    """Section → key → every value given to it, in order (a key may repeat)."""
    unit: Unit = {}
    section: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = unit.setdefault(line.strip("[]"), defaultdict(list))
            continue
        key, _, value = line.partition("=")
        section[key.strip()].append(value.strip())
    return unit


def one(unit: Unit, key: str, section: str = "Service") -> str:
    (value,) = unit[section][key]
    return value


def seconds(value: str) -> float:
    assert value.isdigit(), f"a plain number of seconds, not {value!r}"
    return float(value)


@pytest.fixture(scope="module")
def unit() -> Unit:
    return read_unit()


def test_it_is_a_notify_service_only_the_main_process_may_notify(unit: Unit) -> None:
    assert one(unit, "Type") == "notify"
    assert one(unit, "NotifyAccess") == "main"
    assert one(unit, "ExecStart").endswith(" up -c /etc/flowforge/config.yaml")
    assert one(unit, "ExecStart").split()[0].endswith("/flowforge")


def test_a_reload_is_the_sighup_the_supervisor_answers_with_a_rolling_restart(unit: Unit) -> None:
    assert one(unit, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert signal.SIGHUP in HANDLED_SIGNALS


def test_stop_signals_the_supervisor_alone_and_outlasts_its_drain(unit: Unit) -> None:
    assert one(unit, "KillMode") == "mixed"  # SIGTERM to the main pid; SIGKILL to all at the end
    assert one(unit, "KillSignal") == "SIGTERM"
    drain = ProcessesConfig().drain_timeout_s
    assert seconds(one(unit, "TimeoutStopSec")) >= drain + STOP_MARGIN_S


def test_the_watchdog_leaves_the_loop_room(unit: Unit) -> None:
    watchdog = seconds(one(unit, "WatchdogSec"))
    # pets every WatchdogSec/2, at most a tick late; a host under load needs seconds more
    assert watchdog / 2 >= 10 * TICK_S
    assert seconds(one(unit, "TimeoutStartSec")) > 0


def test_restart_on_failure_except_the_exit_codes_that_need_an_operator(unit: Unit) -> None:
    assert one(unit, "Restart") == "on-failure"
    prevented = {int(code) for code in one(unit, "RestartPreventExitStatus").split()}
    assert prevented == {exitcodes.USAGE, exitcodes.BOOT_FAILED, exitcodes.RESTART_LIMIT}
    assert exitcodes.INTERNAL not in prevented
    readme = (REPO / "README.md").read_text()
    for code in prevented:  # the README's table says what each means
        assert f"\n| {code} | " in readme


def test_it_runs_as_its_own_user_without_privileges(unit: Unit) -> None:
    assert one(unit, "User") not in ("", "root", "0")
    assert one(unit, "NoNewPrivileges") == "yes"
    assert one(unit, "ProtectSystem") == "strict"
    assert one(unit, "ProtectHome") == "yes"
    assert one(unit, "PrivateTmp") == "yes"
    assert one(unit, "CapabilityBoundingSet") == ""
    assert one(unit, "WorkingDirectory") == f"/var/lib/{one(unit, 'StateDirectory')}"


def test_secrets_come_as_credentials_named_by_the_file_variables(unit: Unit) -> None:
    credentials = dict(c.split(":", 1) for c in unit["Service"]["LoadCredential"])
    env = dict(e.split("=", 1) for e in unit["Service"]["Environment"])
    assert env == {
        f"{ENV_DATABASE_URL}_FILE": "%d/database-url",
        f"{ENV_BROKER_URL}_FILE": "%d/broker-url",
    }
    assert {value.removeprefix("%d/") for value in env.values()} == credentials.keys()
    assert all(path.startswith("/etc/flowforge/credentials/") for path in credentials.values())


def systemd_tool(name: str) -> str:
    """The path of one of systemd's programs; skips without it (fails under CI)."""
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing (Debian package systemd)")
        pytest.skip(f"{name} is missing (Debian package systemd)")
    return path


def test_systemd_accepts_every_line(tmp_path: Path) -> None:
    analyze = systemd_tool("systemd-analyze")
    # verify wants ExecStart's program to exist: this interpreter stands in for the venv's
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/flowforge/bin/flowforge", sys.executable))
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0"}
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == "", "systemd ignores a line of the unit"


def test_the_sysusers_file_makes_the_units_user_at_home_in_its_state_directory(
    unit: Unit, tmp_path: Path
) -> None:
    sysusers = systemd_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    done = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    users = [line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()]
    (user,) = [u for u in users if u[0] == one(unit, "User")]
    assert user[5] == one(unit, "WorkingDirectory") and user[6].endswith("/nologin")
    assert int(user[2]) < 1000  # a system user
    groups = (tmp_path / "etc" / "group").read_text().splitlines()
    assert any(g.split(":")[0] == one(unit, "Group") for g in groups)
