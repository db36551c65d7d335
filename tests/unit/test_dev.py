"""``flowforge dev`` without services: its loop through seams (a fake tree, a scripted watcher and
clock), its command line, the environment it gives the tree, its ports and token, and the check
that keeps a broken handler file from reaching the workers (docs/failure-model.md, mode 98)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main
from flowforge.devloop import (
    DevLoop,
    StopSignals,
    check_code,
    describe,
    dev_token,
    tree_environment,
)
from flowforge.devservices import project
from flowforge.devservices.project import Ports, ProjectServices, choose_ports, recorded_ports

CONFIG = Path("/project/flowforge.yaml")


class FakeTree:
    """A tree that records the signals it gets; exits when told to (``exit_on_term``)."""

    def __init__(self, exit_on_term: bool = True) -> None:
        self.signals: list[int] = []
        self.code: int | None = None
        self.exit_on_term = exit_on_term

    def poll(self) -> int | None:
        return self.code

    def send(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGKILL or (signum == signal.SIGTERM and self.exit_on_term):
            self.code = -signum if signum == signal.SIGKILL else 0


class Script:
    """The loop's world: scripted changes (one entry per poll), a check's answers, a clock
    that ``wait`` moves, and a stop once the script has run out."""

    def __init__(self, changes: list[set[str]], problems: list[str | None] | None = None) -> None:
        self.changes = [frozenset(CONFIG.parent / n for n in c) for c in changes]
        self.problems = list(problems or [])
        self.trees: list[FakeTree] = []
        self.lines: list[str] = []
        self.now = 0.0
        self.stops = StopSignals()
        self.tree_factory = FakeTree

    def loop(self) -> DevLoop:
        return DevLoop(
            start_tree=self.start_tree,
            check=lambda: self.problems.pop(0) if self.problems else None,
            changes=self.next_changes,
            wait=self.wait,
            clock=lambda: self.now,
            say=self.lines.append,
            stops=self.stops,
            config_path=CONFIG,
            drain_timeout_s=25.0,
        )

    def start_tree(self) -> FakeTree:
        self.trees.append(self.tree_factory())
        return self.trees[-1]

    def next_changes(self) -> frozenset[Path]:
        if not self.changes:
            self.stops.count += 1  # the script is over: Ctrl-C
            return frozenset()
        return self.changes.pop(0)

    def wait(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds
        assert self.now < 1000, "the loop did not end"


def test_a_change_reloads_the_workers_with_one_line_and_a_stop_drains_the_tree() -> None:
    world = Script([set(), {"handlers.py"}, set(), {"handlers.py", "workflows/a.yaml"}])
    assert world.loop().run() == 0
    (tree,) = world.trees
    assert tree.signals == [signal.SIGHUP, signal.SIGHUP, signal.SIGTERM]
    assert world.lines == [
        "reload 1: handlers.py changed; rolling restart",
        "reload 2: handlers.py, workflows/a.yaml changed; rolling restart",
    ]


def test_code_that_does_not_load_is_not_reloaded_and_the_next_good_save_is() -> None:
    world = Script(
        [{"handlers.py"}, {"handlers.py"}],
        problems=[None, "handlers: cannot import 'handlers': SyntaxError(...)", None],
    )
    world.loop().run()
    (tree,) = world.trees
    assert tree.signals == [signal.SIGHUP, signal.SIGTERM]  # only the second save reloads
    assert world.lines[0] == (
        "not reloaded (handlers.py): handlers: cannot import 'handlers': SyntaxError(...); "
        "the tree keeps the code it loaded"
    )
    assert world.lines[1].startswith("reload 1: handlers.py changed")


def test_a_tree_that_cannot_load_its_code_starts_once_the_code_is_fixed() -> None:
    world = Script([{"handlers.py"}, {"handlers.py"}], problems=["bad 1", "bad 2", None])
    world.loop().run()
    assert len(world.trees) == 1
    assert world.lines == [
        "the tree did not start: bad 1; fix it and save to start the tree",
        "changed: handlers.py; still not started: bad 2; fix it and save to start the tree",
    ]


def test_a_tree_that_exits_by_itself_is_started_again_on_the_next_change() -> None:
    world = Script([set(), set(), {"handlers.py"}])
    loop = world.loop()
    original = world.next_changes

    def changes() -> frozenset[Path]:
        if len(world.changes) == 2:
            world.trees[0].code = 3  # a worker failed to boot: the tree stopped
        return original()

    loop.changes = changes
    loop.run()
    assert len(world.trees) == 2
    assert world.lines[0] == "the tree exited (3); save a file to start it again"
    assert world.trees[1].signals == [signal.SIGTERM]


def test_a_change_to_the_config_is_said_not_reloaded() -> None:
    world = Script([{"flowforge.yaml"}])
    world.loop().run()
    assert world.trees[0].signals == [signal.SIGTERM]
    assert world.lines == [
        "the config changed: restart flowforge dev to apply it (a reload keeps it)"
    ]


def test_a_tree_that_does_not_drain_gets_the_fast_stop_then_sigkill() -> None:
    world = Script([])
    world.tree_factory = lambda: FakeTree(exit_on_term=False)
    assert world.loop().run() == -signal.SIGKILL
    (tree,) = world.trees
    assert tree.signals == [signal.SIGTERM, signal.SIGTERM, signal.SIGKILL]
    # drain timeout (25 s) + grace, then the fast stop's grace; each checked every 0.5 s
    assert 45.0 <= world.now <= 47.0
    assert world.lines == ["the tree did not stop; SIGKILL"]


def test_a_second_stop_is_forwarded_at_once_as_the_fast_stop() -> None:
    world = Script([])
    world.tree_factory = lambda: FakeTree(exit_on_term=False)
    loop = world.loop()
    original = world.wait

    def wait(seconds: float) -> None:
        original(seconds)
        if world.now == 1.0:
            world.stops.count += 1  # Ctrl-C again

    loop.wait = wait
    loop.run()
    assert world.trees[0].signals[:2] == [signal.SIGTERM, signal.SIGTERM]
    assert world.now < 15.0  # the second came from the user, not from the deadline


def test_a_stop_with_no_tree_running_ends_at_once() -> None:
    world = Script([], problems=["bad"])
    assert world.loop().run() == 0
    assert world.trees == []


def test_a_reload_line_names_three_files_and_counts_the_rest() -> None:
    paths = [CONFIG.parent / f"m{i}.py" for i in range(5)] + [Path("/elsewhere/x.py")]
    assert describe(paths, CONFIG.parent) == "/elsewhere/x.py, m0.py, m1.py and 3 more"
    assert describe([CONFIG.parent / "a\x1b[31m.py"], CONFIG.parent) == "a\\x1b[31m.py"


def test_the_tree_gets_the_private_urls_and_the_dev_token_and_no_file_variables() -> None:
    base = {
        "PATH": "/bin",
        "FLOWFORGE_DATABASE_URL_FILE": "/run/secrets/db",
        "FLOWFORGE_DATABASE_PASSWORD_FILE": "/run/secrets/dbpw",
        "FLOWFORGE_BROKER_URL_FILE": "/run/secrets/mq",
        "FLOWFORGE_BROKER_PASSWORD_FILE": "/run/secrets/mqpw",
        "MY_TOKEN_FILE": "/run/secrets/token",
    }
    env = tree_environment(base, ("postgresql://db", "amqp://mq"), ("MY_TOKEN", "t0k"))
    assert env == {
        "PATH": "/bin",
        "FLOWFORGE_DATABASE_URL": "postgresql://db",
        "FLOWFORGE_BROKER_URL": "amqp://mq",
        "MY_TOKEN": "t0k",
    }
    assert tree_environment(base, None, None) == base  # --use-config-urls: as given


def test_the_dev_token_is_made_once_readable_only_by_its_owner(tmp_path: Path) -> None:
    token = dev_token(tmp_path)
    assert len(token) >= 32
    assert stat.S_IMODE((tmp_path / "api-token").stat().st_mode) == 0o600
    assert dev_token(tmp_path) == token


def test_ports_are_recorded_reused_and_chosen_free_and_apart_from_the_shared_ones(
    tmp_path: Path,
) -> None:
    ports = choose_ports(tmp_path)
    assert ports == choose_ports(tmp_path)  # a project starts at its own place
    assert not set(ports.all()) & project.AVOIDED
    assert ports.all() == tuple(range(ports.pg, ports.pg + 4))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.amqp))
        taken.listen()
        assert ports.amqp not in choose_ports(tmp_path).all()
    assert recorded_ports(tmp_path) is None
    (tmp_path / project.STATE_FILE).write_text('{"pg_port": 1}')
    assert recorded_ports(tmp_path) is None  # not a file this code wrote
    (tmp_path / project.STATE_FILE).write_text(
        '{"pg_port": 21000, "amqp_port": 21001, "dist_port": 21002}'
    )
    services = ProjectServices.for_project(tmp_path, amqp_port=22000)
    assert services.ports == Ports(21000, 22000, 21002)


# --- the command line ---------------------------------------------------------------------


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text("handlers: []\nprocesses: {workers: 1}\n")
    return path


@pytest.fixture
def no_binaries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setattr(ProjectServices, "pg_bin_dir", tmp_path / "no-postgres")
    yield


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    try:
        assert main(argv) == code
    except SystemExit as exc:  # argparse's refusals
        assert exc.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--pg-port", "80"], "not a port from 1024 to 65535: '80'"),
        (["--amqp-port", "http"], "not a port"),
        (["--dist-port", "70000"], "not a port"),
        (["--interval", "0"], "not a number of seconds from 0.1 to 10.0"),
        (["--interval", "nan"], "not a number of seconds"),
        (["--interval", "soon"], "not a number of seconds"),
        (["--use-config-urls", "--pg-port", "21000"], "are for the private services"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], config: Path, extra: list[str], said: str
) -> None:
    assert said in _refused(capsys, ["dev", "-c", str(config), *extra], exitcodes.USAGE)
    assert not (config.parent / ".flowforge-dev").exists()


def test_without_a_config_file_it_says_how_to_give_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLOWFORGE_CONFIG", raising=False)
    assert "needs a config file: -c CONFIG" in _refused(capsys, ["dev"], exitcodes.USAGE)


def test_a_bad_config_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], config: Path
) -> None:
    config.write_text("processes: {wrkers: 1}\n")
    assert "unknown key" in _refused(capsys, ["dev", "-c", str(config)], exitcodes.USAGE)
    assert not (config.parent / ".flowforge-dev").exists()


@pytest.mark.usefixtures("no_binaries")
def test_missing_postgresql_is_one_line_naming_its_package_and_exit_8(
    capsys: pytest.CaptureFixture[str], config: Path
) -> None:
    err = _refused(capsys, ["dev", "-c", str(config)], exitcodes.SERVICE_MISSING)
    assert "install the Debian package postgresql-15" in err
    assert not list((config.parent / ".flowforge-dev").glob("pg-*"))  # nothing was made


def test_missing_rabbitmq_is_found_before_postgresql_starts(
    capsys: pytest.CaptureFixture[str], config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ProjectServices, "rabbit_bin_dir", config.parent / "no-rabbitmq")
    err = _refused(capsys, ["dev", "-c", str(config)], exitcodes.SERVICE_MISSING)
    assert "install the Debian package rabbitmq-server" in err
    assert not list((config.parent / ".flowforge-dev").glob("pg-*"))


# --- the check before a reload (failure mode 98) ------------------------------------------


def _project(tmp_path: Path, handler: str) -> tuple[Path, dict[str, str]]:
    (tmp_path / "devcheck_handlers.py").write_text(handler)
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "w.yaml").write_text(
        "name: w\ntasks:\n  - {name: t, handler: devcheck.t}\n"
    )
    config = tmp_path / "flowforge.yaml"
    config.write_text("handlers: [devcheck_handlers]\nworkflows: [workflows]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return config, env


GOOD = "from flowforge import task\n\n\n@task('devcheck.t')\ndef t(ctx):\n    return 1\n"


def test_the_check_passes_code_that_loads(tmp_path: Path) -> None:
    config, env = _project(tmp_path, GOOD)
    assert check_code(config, env) is None


def test_the_check_names_a_syntax_error_in_one_line(tmp_path: Path) -> None:
    config, env = _project(tmp_path, GOOD + "def broken(:\n")
    problem = check_code(config, env)
    assert problem is not None
    assert "cannot import 'devcheck_handlers'" in problem and "SyntaxError" in problem
    assert "\n" not in problem


def test_the_check_names_a_handler_the_workflow_lost(tmp_path: Path) -> None:
    config, env = _project(tmp_path, GOOD.replace("devcheck.t", "devcheck.renamed"))
    problem = check_code(config, env)
    assert problem is not None and "devcheck.t" in problem
