"""``python -m flowforge.healthcheck``: the container image's HEALTHCHECK.

The probe's URL follows the config's ``api.listen`` (a wildcard address is probed on loopback);
it exits 0 only on a 200, and 1 with one line on stderr otherwise — never 2, which Docker
reserves. Against a small HTTP server on loopback; the image itself runs it in
tests/container/test_image.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flowforge.healthcheck import ProbeError, live_url, main, probe
from tests.harness.resources import free_ports


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health/live" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:  # quiet
        pass


@pytest.fixture
def server() -> Iterator[int]:
    """An HTTP server on 127.0.0.1: 200 on /health/live, 503 elsewhere; its port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    # shutdown() waits for the loop's next poll: 0.05 s, not the default 0.5 s per test
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("0.0.0.0:8080", "http://127.0.0.1:8080/health/live"),
        ("[::]:8080", "http://[::1]:8080/health/live"),
        (":9000", "http://127.0.0.1:9000/health/live"),
        ("127.0.0.1:8080", "http://127.0.0.1:8080/health/live"),
        ("[::1]:80", "http://[::1]:80/health/live"),
        ("flowforge.internal:8443", "http://flowforge.internal:8443/health/live"),
    ],
)
def test_the_url_follows_the_listen_address_and_wildcards_go_to_loopback(
    listen: str, url: str
) -> None:
    assert live_url(listen) == url


@pytest.mark.parametrize("listen", ["8080", "localhost", "host:http"])
def test_a_listen_address_without_a_port_is_refused(listen: str) -> None:
    with pytest.raises(ProbeError, match="HOST:PORT"):
        live_url(listen)


def test_only_a_200_is_live(server: int) -> None:
    probe(f"http://127.0.0.1:{server}/health/live")
    with pytest.raises(ProbeError, match="HTTP 503"):
        probe(f"http://127.0.0.1:{server}/health/ready")
    (closed,) = free_ports(1)
    with pytest.raises(ProbeError, match="refused"):
        probe(f"http://127.0.0.1:{closed}/health/live")
    with pytest.raises(ProbeError, match="not an http"):
        probe("file:///etc/passwd")


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_main_probes_the_configured_api_and_exits_0(server: int, tmp_path: Path) -> None:
    config = _config(tmp_path, f"api:\n  listen: 0.0.0.0:{server}\n")
    assert main(["-c", config]) == 0


def test_main_reads_flowforge_config_when_no_option_names_a_file(
    server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWFORGE_CONFIG", _config(tmp_path, f"api:\n  listen: :{server}\n"))
    assert main([]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("processes:\n  workers: 1\n", "the config has no api section"),
        ("api:\n  listen: [\n", "config.yaml"),
        ("api:\n  listne: x\n", "listne: unknown key"),
        ("api:\n  listen: 127.0.0.1:{closed}\n", "refused"),
    ],
)
def test_main_says_why_in_one_line_and_exits_1_never_2(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (closed,) = free_ports(1)
    config = _config(tmp_path, text.format(closed=closed))
    assert main(["-c", config]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flowforge healthcheck: ") and message in line


def test_an_explicit_url_wins_over_the_config(server: int, tmp_path: Path) -> None:
    config = _config(tmp_path, "processes:\n  workers: 1\n")  # no api: only --url can pass
    assert main(["-c", config, "--url", f"http://127.0.0.1:{server}/health/live"]) == 0
