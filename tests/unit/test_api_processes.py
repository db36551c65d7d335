"""``api.processes``: several api children of one tree on the one listening socket (issue 22),
without services. The key is validated like every other; ``flowforge up``'s api spec asks the
supervisor for that many children, the banner says how many; over the fake OS
(tests/fakeos.py, with the real specs of flowforge/up.py) the tree starts them all, and one
that dies is restarted alone while the others are left serving (failure mode 100);
a rolling restart replaces each of them. tests/integration/test_api_processes.py proves it
with real processes, a real socket and a SIGKILL.
"""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from flowforge import up
from flowforge.config import MAX_API_PROCESSES, Config, load_config
from flowforge.errors import ConfigError
from tests.unit.test_supervisor_loop import Loop, logged

__all__ = ["logged"]  # the fixture: the supervisor's log records by action


def config_of(tmp_path: Path, api: str) -> Config:
    path = tmp_path / "flowforge.yaml"
    path.write_text("api:\n  listen: 127.0.0.1:0\n" + textwrap.indent(textwrap.dedent(api), "  "))
    return load_config(path, env={})


def test_one_api_process_by_default(tmp_path: Path) -> None:
    config = config_of(tmp_path, "")
    assert config.api is not None and config.api.processes == 1
    (api,) = [s for s in up.build_specs(config) if s.name == "api"]
    assert api.count == 1
    assert "api on http://127.0.0.1:0\n" in up.banner(config)


@pytest.mark.parametrize("value", ["0", "-1", str(MAX_API_PROCESSES + 1)])
def test_a_count_out_of_range_is_refused_naming_the_key_and_the_range(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_of(tmp_path, f"processes: {value}\n")
    message = str(info.value)
    assert "api" in message and f"processes must be between 1 and {MAX_API_PROCESSES}" in message
    assert "\n" not in message


@pytest.mark.parametrize(("value", "expected"), [("true", "an integer"), ('"two"', "an integer")])
def test_a_count_that_is_no_integer_is_refused_by_its_path(
    tmp_path: Path, value: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_of(tmp_path, f"processes: {value}\n")
    assert "api.processes" in str(info.value) and expected in str(info.value)


def test_the_api_spec_asks_for_that_many_children_and_the_banner_says_so(tmp_path: Path) -> None:
    config = config_of(tmp_path, f"processes: {MAX_API_PROCESSES}\n")
    specs = {s.name: s for s in up.build_specs(config)}
    assert specs["api"].count == MAX_API_PROCESSES
    assert specs["api"].rolling and not specs["api"].scalable  # SIGTTIN scales workers only
    assert [s.count for n, s in specs.items() if n != "api"] == [1, 4, 1]
    assert f"api on http://127.0.0.1:0 ({MAX_API_PROCESSES} processes)" in up.banner(config)


def tree_of(tmp_path: Path, processes: int) -> Loop:
    """The real specs of ``flowforge up`` over the fake OS, every child started and ready."""
    config = config_of(tmp_path, f"processes: {processes}\n")
    loop = Loop(*up.build_specs(config), exits_on={signal.SIGTERM: 0})
    loop.turn()
    for child in loop.alive():
        loop.os.ready(child.pid)
    loop.run_for(1.0)
    return loop


def test_every_api_child_starts_and_the_readiness_counts_them(tmp_path: Path) -> None:
    loop = tree_of(tmp_path, 3)
    apis = loop.alive("api")
    assert [c.ctx.instance for c in apis] == [1, 2, 3]
    assert loop.tree.readiness()["api"] == (3, 3)


def test_one_api_child_killed_is_restarted_alone_while_the_others_serve_on(
    tmp_path: Path, logged: Callable[[str], list[str]]
) -> None:
    """Failure mode 100, through the seam: the others get no signal, the tree does not drain,
    and the dead child's slot is started again after its backoff."""
    loop = tree_of(tmp_path, 3)
    first, killed, third = loop.alive("api")
    loop.os.exit(killed.pid, -signal.SIGKILL)
    loop.until(lambda: len(loop.alive("api")) == 3)
    (new,) = [c for c in loop.alive("api") if c not in (first, third)]
    assert new.ctx.instance == killed.ctx.instance == 2
    assert first.signals == [] and third.signals == [] and first.alive and third.alive
    assert loop.code is None and not logged("draining")
    (died,) = logged("child_died")
    assert f"api-2 (pid {killed.pid}) killed by SIGKILL" in died
    assert loop.tree.readiness()["api"] == (2, 3)  # the new one has not said it is ready yet
    loop.os.ready(new.pid)
    loop.turn()
    assert loop.tree.readiness()["api"] == (3, 3)


def test_a_rolling_restart_replaces_each_api_child_one_at_a_time(
    tmp_path: Path, logged: Callable[[str], list[str]]
) -> None:
    loop = tree_of(tmp_path, 2)
    old = loop.alive("api")
    loop.os.deliver(signal.SIGHUP)
    replaced: list[int] = []
    while len(replaced) < len(loop.os.children):
        loop.until(
            lambda: (
                logged("rolled")
                or [c for c in loop.alive() if not c.ctx.table.is_ready(c.ctx.slot)]
            )
        )
        if logged("rolled"):
            break
        (booting,) = [c for c in loop.alive() if not c.ctx.table.is_ready(c.ctx.slot)]
        # at most one child booting at any time: the old api children serve until replaced
        assert sum(c.alive for c in old) >= len(old) - 1
        loop.os.ready(booting.pid)
        replaced.append(booting.pid)
        loop.turn()
    assert not any(c.alive for c in old)
    assert len(loop.alive("api")) == 2
    assert logged("rolled") == [f"rolling restart done: {len(replaced)} child(ren) replaced"]
