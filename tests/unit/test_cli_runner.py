"""tests/cli_runner.py answers as a fresh ``python -m flowforge.cli`` does.

The CLI tests fork the command off a preloaded interpreter; these compare it with a real
subprocess on commands that need no service (exit status, both streams, a non-UTF-8 argument,
the environment of each call), and check that a command past its timeout is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli_runner

REPO = Path(__file__).resolve().parents[2]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    return {**env, **extra}


def fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowforge.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["--version"], {}),
        (["no-such-command"], {}),
        (["-c", "missing-\udcff.yaml", "migrate"], {}),  # bytes that are not UTF-8
        (["runs"], {"FLOWFORGE_CONFIG": "from-the-environment.yaml"}),
    ],
    ids=["version", "usage-error", "not-utf8-argument", "environment"],
)
def test_the_runner_answers_as_a_fresh_interpreter(args: list[str], extra: dict[str, str]) -> None:
    env = environment(**extra)
    real = fresh(args, env)
    forked = cli_runner.run(args, env, cwd=REPO)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        real.returncode,
        real.stdout,
        real.stderr,
    )
    assert forked.stdout or forked.stderr  # each of them said something


def test_a_call_sees_only_its_own_environment(tmp_path: Path) -> None:
    first = cli_runner.run(["runs"], environment(FLOWFORGE_CONFIG=str(tmp_path / "a.yaml")))
    second = cli_runner.run(["runs"], environment(FLOWFORGE_CONFIG=str(tmp_path / "b.yaml")))
    assert "a.yaml" in first.stderr and "b.yaml" not in first.stderr
    assert "b.yaml" in second.stderr and "a.yaml" not in second.stderr


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path: Path) -> None:
    config = tmp_path / "flowforge.yaml"  # a role retries an outage until it is stopped
    config.write_text("database:\n  url: postgresql://postgres@127.0.0.1:1/x\n")
    with pytest.raises(subprocess.TimeoutExpired):
        cli_runner.run(["-c", str(config), "role", "scheduler"], environment(), timeout=0.5)
    assert cli_runner.run(["--version"], environment()).returncode == 0
