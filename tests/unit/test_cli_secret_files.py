"""A secret file that cannot be used stops every command with the config exit code (2) and one
line on stderr naming who pointed at the file, its path and the reason; never a traceback,
never the file's content. ``flowforge up`` stops before it starts anything, and the tree entry
it becomes (which reads the config again) says the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-91c2"
RUN_ID = "00000000-0000-0000-0000-000000000000"


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWFORGE_", "PG"))}
    return {**env, **more}


def write_config(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text(text + f"workflows: [{REPO / 'config' / 'workflows'}]\n")
    return path


def assert_one_line(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == exitcodes.USAGE, (code, err)
    assert out == ""
    assert err.startswith("flowforge: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and SECRET not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    "args",
    [
        ["workflows", "list"],
        ["runs"],
        ["status", RUN_ID],
        ["migrate"],
        ["-vv", "trigger", "hello"],
        ["role", "scheduler"],
    ],
    ids=" ".join,
)
def test_every_command_refuses_a_missing_secret_file_with_one_line(
    tmp_path: Path,
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path, "database:\n  password_file: secrets/db\n")
    for name in [k for k in os.environ if k.startswith(("FLOWFORGE_", "PG"))]:
        monkeypatch.delenv(name)
    code = main(["-c", str(config), *args])
    out, err = capfd.readouterr()
    expected = (
        f"flowforge: {config}: database.password_file: cannot use {tmp_path / 'secrets/db'}:"
        " No such file or directory\n"
    )
    assert_one_line(code, out, err)
    assert err == expected


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"FLOWFORGE_DATABASE_PASSWORD_FILE": "."}, "FLOWFORGE_DATABASE_PASSWORD_FILE: cannot use"),
        ({"FLOWFORGE_API_TOKEN_FILE": "token"}, "FLOWFORGE_API_TOKEN_FILE: cannot use"),
        (
            {
                "FLOWFORGE_BROKER_URL": f"amqp://ff:{SECRET}@mq1/%2F",
                "FLOWFORGE_BROKER_URL_FILE": "token",
            },
            "FLOWFORGE_BROKER_URL and FLOWFORGE_BROKER_URL_FILE are both set",
        ),
    ],
    ids=["directory", "two-lines", "value-and-file"],
)
def test_up_stops_before_starting_anything(
    tmp_path: Path,
    env: dict[str, str],
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "token").write_text(f"{SECRET}\n{SECRET}\n")
    config = write_config(tmp_path, "api:\n  listen: 127.0.0.1:1\n")

    def become_tree(path: str | None, label: str) -> None:
        raise AssertionError("the tree was started")

    monkeypatch.setattr("flowforge.tree.become_tree", become_tree)
    for name in [k for k in os.environ if k.startswith(("FLOWFORGE_", "PG"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["-c", str(config), "up"])
    out, err = capfd.readouterr()
    assert_one_line(code, out, err, f"{config}: {fragment}")


def test_the_real_command_says_one_line_without_a_traceback(tmp_path: Path) -> None:
    """The console entry end to end: ``flowforge up`` with a password file that is missing."""
    config = write_config(tmp_path, "database:\n  password_file: /nonexistent/db-password\n")
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-vv", "-c", str(config), "up"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert_one_line(
        done.returncode,
        done.stdout,
        done.stderr,
        "database.password_file: cannot use /nonexistent/db-password: No such file or directory",
    )


def test_the_tree_entry_rereading_the_config_says_the_same(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``flowforge up`` checks the config, then becomes ``python -m flowforge.tree``, which reads
    it again: a secret file gone in between is the same one line and exit 2."""
    from flowforge.tree import main as tree_main

    config = write_config(tmp_path, "broker:\n  url: amqp://ff@mq1/%2F\n  password_file: mq\n")
    code = tree_main(["flowforge.yaml", str(REPO), str(config)])
    out, err = capfd.readouterr()
    assert_one_line(
        code, out, err, f"broker.password_file: cannot use {tmp_path / 'mq'}: No such file"
    )
