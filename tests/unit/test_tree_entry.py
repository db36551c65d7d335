"""``flowforge up`` validates the config, then becomes ``python -m flowforge.tree`` (same pid).

The new interpreter holds none of the command line's modules, so neither do the supervisor and
the children it forks (docs/performance.md, "Memory"). The whole tree's behaviour through this
entry is proven by every test that runs ``flowforge up`` (tests/chaos/test_supervisor.py checks
the supervisor keeps the pid it was started with); here, the entry itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main
from tests.helpers import modules_after_importing


def test_the_tree_entry_loads_none_of_the_command_line() -> None:
    loaded = modules_after_importing("flowforge.tree", "flowforge.up")
    assert "argparse" not in loaded
    assert {m for m in loaded if m.startswith("flowforge.cli.")} == {"flowforge.cli.exitcodes"}


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "usage: python -P -m flowforge.tree"), (["x.yaml", "", "/nonexistent/x.yaml"], "x.yaml")],
)
def test_the_tree_entry_refuses_bad_arguments_with_one_line_and_2(
    args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.tree", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == exitcodes.USAGE
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowforge: ") and message in lines[0]


def test_up_validates_the_config_then_becomes_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    became: list[tuple[str | None, str]] = []

    def fake_become_tree(path: str | None, label: str) -> None:
        became.append((path, label))
        raise SystemExit(0)  # os.execv does not return either

    monkeypatch.setattr("flowforge.tree.become_tree", fake_become_tree)
    good = tmp_path / "good.yaml"
    good.write_text("processes:\n  workers: 2\n")
    with pytest.raises(SystemExit):
        main(["-c", str(good), "up"])
    assert became == [(str(good), "good.yaml")]

    bad = tmp_path / "bad.yaml"
    bad.write_text("processes:\n  workers: many\n")
    assert main(["-c", str(bad), "up"]) == exitcodes.USAGE
    assert len(became) == 1, "a bad config must not start anything"


def test_up_names_the_config_from_the_environment_when_no_option_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container image runs plain ``flowforge up`` with $FLOWFORGE_CONFIG set: the tree
    reads that file again and its title names it, not "defaults"."""
    became: list[tuple[str | None, str]] = []

    def fake_become_tree(path: str | None, label: str) -> None:
        became.append((path, label))
        raise SystemExit(0)

    monkeypatch.setattr("flowforge.tree.become_tree", fake_become_tree)
    config = tmp_path / "config.yaml"
    config.write_text("processes:\n  workers: 2\n")
    monkeypatch.setenv("FLOWFORGE_CONFIG", str(config))
    with pytest.raises(SystemExit):
        main(["up"])
    assert became == [(str(config), "config.yaml")]


def test_up_runs_the_tree_in_its_own_process_when_no_interpreter_can_be_executed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))  # execv: OSError
    monkeypatch.setattr("flowforge.up.run", lambda _config, label: ran.append(label) or 0)
    config = tmp_path / "here.yaml"
    config.write_text("processes:\n  workers: 1\n")
    assert main(["-c", str(config), "up"]) == exitcodes.OK
    assert ran == ["here.yaml"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flowforge: no fresh interpreter (") and "running the tree here" in line
