"""SIGHUP reloads every child that holds handler code or workflow definitions (issue 21), through
the seams, without services; tests/integration/test_reload.py proves it on a real tree under load.

- the tree marks the workers, the scheduler and the api as rolling, in that order, and not the
  publisher;
- ``flowforge up`` binds the api's socket before anything starts (a bind error is one line and
  exit 3) and loads no user code and no web stack: each child loads them after its fork;
- every api child serves the inherited socket, every other child closes its copy;
- two servers on one socket: the old one stops accepting and finishes the request under way
  while the new one answers the requests that come meanwhile — none refused, none cut.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from waitress import wasyncore

from flowforge import boot, up
from flowforge.api.listener import bind_listener
from flowforge.api.server import serve_out
from flowforge.api.wsgi_server import ClientRules, JsonErrorServer, make_server
from flowforge.config import Config, load_config
from flowforge.errors import BootError
from supervisor import exitcodes
from supervisor.child import ChildContext
from supervisor.slots import SlotTable
from tests.helpers import wait_for

#: A bound on every wait of these tests (seconds), never a sleep.
WAIT_S = 10.0


def config_with_api(tmp_path: Path, listen: str = "127.0.0.1:0", more: str = "") -> Config:
    path = tmp_path / "flowforge.yaml"
    path.write_text(f"api:\n  listen: {listen}\n" + textwrap.dedent(more))
    return load_config(path, env={})


# ------------------------------------------------------------------ the specs


def test_workers_then_the_scheduler_then_the_api_are_rolled_and_the_publisher_is_not(
    tmp_path: Path,
) -> None:
    config = config_with_api(
        tmp_path, more="processes:\n  pools: [{queue: a, workers: 2}, {queue: b, workers: 1}]\n"
    )
    specs = {s.name: s for s in up.build_specs(config)}
    rolled = sorted((s.roll_order, name) for name, s in specs.items() if s.rolling)
    assert [name for _, name in rolled] == ["worker", "worker:b", "scheduler", "api"]
    orders = [specs[name].roll_order for name in ("worker", "worker:b", "scheduler", "api")]
    assert orders[0] == orders[1] < orders[2] < orders[3]
    assert not specs["publisher"].rolling


# ------------------------------------------------------------------ the socket made by `up`


def test_a_taken_api_address_stops_up_before_anything_starts_with_one_line_and_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = config_with_api(tmp_path, f"127.0.0.1:{port}")
        monkeypatch.setattr(up, "_supervise", lambda *_args: pytest.fail("the tree started"))
        assert up.run(config, "test") == exitcodes.BOOT_FAILED
    err = capsys.readouterr().err
    assert err == f"flowforge: api cannot listen on 127.0.0.1:{port}: Address already in use\n"


@pytest.mark.parametrize("listen", ["no-such-host.invalid:8080", "localhost:http"])
def test_an_address_that_cannot_be_bound_is_a_boot_error_naming_it(listen: str) -> None:
    with pytest.raises(BootError, match=f"^api.*{listen}") as raised:
        bind_listener(listen)
    assert "\n" not in str(raised.value)


def test_the_supervisor_loads_neither_user_code_nor_the_web_stack(tmp_path: Path) -> None:
    """Every child forked by a reload imports the handler and workflow modules afresh only if
    the supervisor never did; and the api's web stack stays out of the other children."""
    (tmp_path / "reload_probe_handlers.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "reload_probe_flows.py").write_text("raise SystemExit('imported')\n")
    config = tmp_path / "flowforge.yaml"
    config.write_text(
        "api: {listen: '127.0.0.1:0'}\nhandlers: [reload_probe_handlers]\n"
        "workflow_modules: [reload_probe_flows]\n"
    )
    code = (
        "import json, sys\n"
        "from flowforge import up\n"
        "from flowforge.api.listener import bind_listener\n"
        "from flowforge.config import load_config\n"
        f"config = load_config({str(config)!r}, env={{}})\n"
        "listener = bind_listener(config.api.listen)\n"
        "up.build_specs(config, listener)\n"
        "up.preload_driver()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=60,
    )
    loaded = set(out.stdout.split('"'))
    assert not loaded & {"reload_probe_handlers", "reload_probe_flows"}
    assert not {m for m in loaded if m.split(".")[0] in ("waitress", "falcon")}


@pytest.mark.parametrize("name", ["api", "scheduler", "worker", "publisher"])
def test_an_api_child_serves_the_inherited_socket_and_any_other_closes_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[boot.Given] = []

    def fake_run(_name: str, _config: Config, **hooks: Any) -> int:
        handed.append(hooks["given"])
        return 0

    monkeypatch.setattr(boot, "run", fake_run)
    listener = bind_listener("127.0.0.1:0")
    try:
        target = up._role(name, config_with_api(tmp_path), listener)
        ctx = ChildContext(name, 1, 1, 0, SlotTable(4, 1, lambda: 0.0), (name,))
        assert target(ctx) == 0
        (given,) = handed
        if name == "api":
            assert given.listener is listener and listener.fileno() >= 0
        else:
            assert given.listener is None and listener.fileno() == -1
    finally:
        listener.close()


# ------------------------------------------------------------------ two api children, one socket


class Served:
    """A waitress server (FlowForge's) on a socket, its event loop on a thread until told to
    stop, then drained as a retired api child drains (:func:`serve_out`)."""

    def __init__(self, sock: socket.socket, app: Callable[..., Any]) -> None:
        self.map: dict[int, Any] = {}
        self.server: JsonErrorServer = make_server(
            app, self.map, 1024, ClientRules(), sock=sock, threads=2
        )
        self.stop = threading.Event()
        self.drained = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            wasyncore.loop(timeout=0.05, map=self.map, use_poll=True, count=1)
        serve_out(self.server, self.map, lambda: None)
        self.drained.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        self.server.close()
        self.server.task_dispatcher.shutdown(cancel_pending=True, timeout=1)


def app_that_holds(started: threading.Event, release: threading.Event) -> Callable[..., Any]:
    """A WSGI app answering who served it; ``/slow`` waits for ``release`` first."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ["PATH_INFO"] == "/slow":
            started.set()
            release.wait(WAIT_S)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [environ["flowforge.test.who"].encode() * 1000]

    return app


def tagged(app: Callable[..., Any], who: str) -> Callable[..., Any]:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return app({**environ, "flowforge.test.who": who}, start_response)

    return wrapped


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = bind_listener("127.0.0.1:0")
    yield sock
    sock.close()


def test_a_server_given_a_bound_socket_serves_on_it(listener: socket.socket) -> None:
    started, release = threading.Event(), threading.Event()
    served = Served(listener.dup(), tagged(app_that_holds(started, release), "a"))
    try:
        assert get(listener.getsockname()[1], "/") == (200, b"a" * 1000)
    finally:
        served.close()


def test_a_retired_server_finishes_its_request_while_the_next_one_serves_the_rest(
    listener: socket.socket,
) -> None:
    port = listener.getsockname()[1]
    started, release = threading.Event(), threading.Event()
    app = app_that_holds(started, release)
    old = Served(listener.dup(), tagged(app, "old"))  # each child: its own descriptor
    replies: list[tuple[int, bytes]] = []
    slow = threading.Thread(target=lambda: replies.append(get(port, "/slow")), daemon=True)
    slow.start()
    assert started.wait(WAIT_S)
    new = Served(listener.dup(), tagged(app, "new"))
    try:
        old.stop.set()  # SIGTERM: stop accepting, serve what is under way
        wait_for(lambda: not old.server.accepting, WAIT_S, 0.01, "the old server to stop")
        during = [get(port, "/") for _ in range(20)]
        assert during == [(200, b"new" * 1000)] * 20, "a request reached the retired server"
        assert not old.drained.is_set(), "the old server gave up a request under way"
        release.set()
        slow.join(WAIT_S)
        assert replies == [(200, b"old" * 1000)]
        assert old.drained.wait(WAIT_S) and not old.server.active_channels
    finally:
        release.set()
        old.close()
        new.close()
