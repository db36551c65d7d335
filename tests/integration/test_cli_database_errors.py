"""A misconfigured database is said truly, by the real CLI against real PostgreSQL servers.

A missing database, a bad password and an unmigrated database are configuration errors (exit 2,
and ``flowforge up`` fails to boot with exit 3); a port nobody listens on is an outage (exit 7).
Each is one exact line on stderr and no traceback. The bad password needs password
authentication, which the shared server (``trust``) does not do: a private PostgreSQL with its
own ``pg_hba.conf`` (scram-sha-256 for one role) provides it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from flowforge.cli import exitcodes
from tests import cli_runner
from tests.harness.resources import create_database, drop_database, free_ports
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "config" / "workflows"
RUN_ID = "00000000-0000-0000-0000-000000000000"
#: Every command that reads or writes the database, as an operator types it.
DATABASE_COMMANDS = [
    ("runs",),
    ("status", RUN_ID),
    ("cancel", RUN_ID),
    ("trigger", "hello"),
    ("dead", "list"),
    ("dead", "show", RUN_ID),
    ("dead", "requeue", RUN_ID),
    ("rerun", RUN_ID),
    ("stats",),
    ("ps",),
]
UP_TIMEOUT_S = 60


def write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text(
        f"database:\n  url: {url}\n  connect_timeout_s: 1\n"
        f"broker:\n  url: {os.environ.get('FLOWFORGE_TEST_BROKER_URL', 'amqp://127.0.0.1/')}\n"
        f"  queue: ff-dberrors-{os.getpid()}\n"
        f"workflows: [{WORKFLOWS}]\nprocesses:\n  workers: 1\n"
    )
    return path


def operator_env() -> dict[str, str]:
    """This environment without FlowForge's or libpq's variables: only the config speaks."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}


def flowforge(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command, forked off the preloaded CLI (tests/cli_runner.py)."""
    return cli_runner.run(["-c", str(config), *args], operator_env())


def flowforge_up(config: Path) -> subprocess.CompletedProcess[str]:
    """``flowforge up`` in a fresh interpreter, as an operator starts it."""
    return subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
        capture_output=True,
        text=True,
        env=operator_env(),
        timeout=UP_TIMEOUT_S,
        check=False,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stderr == f"flowforge: {line}\n"
    assert result.stdout == ""


def assert_up_fails_to_boot(config: Path, reason: str) -> None:
    """``flowforge up`` exits 3 (boot failure) and its log names ``reason``, no traceback."""
    result = flowforge_up(config)
    assert result.returncode == exitcodes.BOOT, (result.returncode, result.stderr[-2000:])
    assert f"cannot start: {reason}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_database_is_a_config_error(tmp_path: Path, pg_server_url: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(pg_server_url)
    host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
    config = write_config(tmp_path, f"postgresql://postgres@{host}:{port}/ff_no_such_db")
    expected = f'cannot use the database at {host}:{port}: database "ff_no_such_db" does not exist'
    for args in (("migrate",), ("runs",)):
        assert_one_line(flowforge(config, *args), exitcodes.USAGE, expected)


def test_a_port_nobody_listens_on_is_an_outage(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    config = write_config(tmp_path, f"postgresql://postgres@127.0.0.1:{port}/flowforge")
    expected = f"database unavailable: connection refused by 127.0.0.1:{port}"
    for args in (("migrate",), ("runs",)):
        assert_one_line(flowforge(config, *args), exitcodes.UNAVAILABLE, expected)


@pytest.fixture(scope="module")
def unmigrated_url(pg_server_url: str) -> Iterator[str]:
    url = create_database(pg_server_url, "ff_unmigrated")
    yield url
    drop_database(pg_server_url, url)


@pytest.mark.parametrize("args", DATABASE_COMMANDS, ids=" ".join)
def test_an_unmigrated_database_says_run_migrate(
    tmp_path: Path, unmigrated_url: str, args: tuple[str, ...]
) -> None:
    name = psycopg.conninfo.conninfo_to_dict(unmigrated_url)["dbname"]
    result = flowforge(write_config(tmp_path, unmigrated_url), *args)
    assert result.returncode == exitcodes.USAGE, result.stderr
    # the relation named is the first one the command reads: the rest of the line is exact
    pattern = (
        f'flowforge: database "{name}" is not migrated '
        r'\(relation "[a-z_]+" does not exist\): run `flowforge migrate`\n'
    )
    assert re.fullmatch(pattern, result.stderr), result.stderr
    assert result.stdout == ""


def test_up_on_an_unmigrated_database_fails_to_boot(tmp_path: Path, unmigrated_url: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(unmigrated_url)["dbname"]
    assert_up_fails_to_boot(write_config(tmp_path, unmigrated_url), f'database "{name}"')


# ------------------------------------------------------------- password authentication

HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@pytest.fixture(scope="module")
def password_server() -> Iterator[int]:
    """A private PostgreSQL where role ``ff`` (password ``right``) must give its password."""
    from tests.harness.services import PrivatePostgres, ServiceUnavailable

    base_dir = Path(tempfile.mkdtemp(prefix="ff-pgauth-"))
    base_dir.chmod(0o755)  # the postgres account must traverse it
    hba = base_dir / "pg_hba.conf"
    hba.write_text(HBA)
    hba.chmod(0o644)
    (port,) = free_ports(1)
    pg = PrivatePostgres(base_dir, port, extra_settings=[f"hba_file = '{hba}'"])
    try:
        try:
            pg.start()
        except ServiceUnavailable as exc:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"required service missing in CI: {exc}")
            pytest.skip(str(exc))
        with psycopg.connect(pg.admin_url, autocommit=True) as admin:
            admin.execute("CREATE ROLE ff LOGIN PASSWORD 'right'")
            admin.execute("ALTER DATABASE flowforge OWNER TO ff")  # may migrate it
        yield port
    finally:
        pg.stop()
        shutil.rmtree(base_dir, ignore_errors=True)


@pytest.mark.slow  # starts a private PostgreSQL
def test_a_bad_password_is_a_config_error(tmp_path: Path, password_server: int) -> None:
    port = password_server
    right = write_config(tmp_path, f"postgresql://ff:right@127.0.0.1:{port}/flowforge")
    assert flowforge(right, "migrate").returncode == 0  # control: the right one works
    config = write_config(tmp_path, f"postgresql://ff:wrong@127.0.0.1:{port}/flowforge")
    expected = (
        f'cannot use the database at 127.0.0.1:{port}: password authentication failed for user "ff"'
    )
    for args in (("migrate",), ("runs",)):
        result = flowforge(config, *args)
        assert_one_line(result, exitcodes.USAGE, expected)
        assert "wrong" not in result.stderr
    assert_up_fails_to_boot(config, expected)


@pytest.mark.slow  # starts a private PostgreSQL
def test_a_role_that_has_run_logs_a_refused_password_each_time_and_recovers(
    tmp_path: Path, password_server: int
) -> None:
    """After its first start a role rides out a password change (a rotation, say) as it rides
    out an outage, but says what is wrong on every attempt, at ERROR; it resumes once the
    server accepts it again."""
    port = password_server
    config = write_config(tmp_path, f"postgresql://ff:right@127.0.0.1:{port}/flowforge")
    assert flowforge(config, "migrate").returncode == 0
    admin_url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    log = tmp_path / "scheduler.log"
    with log.open("wb") as out:
        role = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "role", "scheduler"],
            env=operator_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    refused = 'password authentication failed for user "ff"'

    def refusals() -> int:
        return sum(
            " ERROR " in line and "cannot use the database" in line and refused in line
            for line in log.read_text().splitlines()
        )

    try:
        with psycopg.connect(admin_url, autocommit=True) as admin:

            def started() -> bool:
                # registered: its initialize is over (the scheduler announces itself last), so
                # what follows meets a role that has run — before, it would be a boot failure
                with psycopg.connect(f"postgresql://ff:right@127.0.0.1:{port}/flowforge") as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM processes WHERE pid = %s AND role = 'scheduler'",
                        (role.pid,),
                    ).fetchone()
                return bool(row and row[0])

            wait_for(started, 30, 0.1, "the scheduler to start")
            admin.execute("ALTER ROLE ff PASSWORD 'rotated'")
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'ff'"
            )
            wait_for(lambda: refusals() >= 2, 30, 0.1, "two logged refusals")
            assert role.poll() is None, log.read_text()[-3000:]
            admin.execute("ALTER ROLE ff PASSWORD 'right'")
            wait_for(lambda: "Scheduler recovered" in log.read_text(), 60, 0.1, "a recovery")
    finally:
        role.send_signal(signal.SIGTERM)
        code = role.wait(30)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "rotated" not in text and "right@" not in text
