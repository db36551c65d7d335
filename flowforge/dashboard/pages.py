"""The dashboard's routes: HTML shells under ``/ui``, their assets under ``/ui/static``, and
``/`` redirecting to ``/ui/``.

Everything is read from the package once, when the app is built, and served from memory: a
page never touches the database (its script asks the JSON api), and an asset is looked up by
exact name in a fixed table, so no request can name a file outside it.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Protocol

import falcon

from flowforge.api.errors import json_error
from flowforge.domain.model import parse_id
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState

PACKAGE = "flowforge.dashboard"
UI_ROOT = "/ui/"
#: Asset suffix → Content-Type. A file with another suffix is not served.
CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
HTML_TYPE = "text/html; charset=utf-8"
#: Revalidate every time (cheap: an ETag); a new release is never hidden behind a stale cache.
CACHE_CONTROL = "no-cache"
NAV = ("overview", "runs", "schedules", "dead", "processes", "flow")


@dataclass(frozen=True)
class PageSpec:
    name: str  # also the template file and the nav entry it highlights
    title: str
    script: str
    nav: str


PAGES = (
    PageSpec("overview", "Overview", "overview.js", "overview"),
    PageSpec("runs", "Runs", "runs.js", "runs"),
    PageSpec("run", "Run", "run.js", "runs"),
    PageSpec("schedules", "Schedules", "schedules.js", "schedules"),
    PageSpec("dead", "Dead tasks", "dead.js", "dead"),
    PageSpec("processes", "Processes", "processes.js", "processes"),
    PageSpec("flow", "Flow control", "flow.js", "flow"),
)


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


class App(Protocol):
    def add_route(self, uri_template: str, resource: object) -> None: ...


def _read(folder: str, name: str) -> str:
    return (resources.files(PACKAGE) / folder / name).read_text(encoding="utf-8")


def _options(values: Iterable[str]) -> str:
    return "\n".join(
        f'      <option value="{html.escape(v)}">{html.escape(v)}</option>' for v in values
    )


def _counts(kind: str, states: Iterable[str]) -> str:
    return "\n".join(
        f'        <div class="c-{html.escape(s)}"><dt>{html.escape(s)}</dt>'
        f'<dd data-testid="{kind}-count-{html.escape(s)}">…</dd></div>'
        for s in states
    )


def render_pages() -> dict[str, bytes]:
    """Every page's HTML by page name (template fragments in the common layout)."""
    layout = Template(_read("templates", "layout.html"))
    fragments = {
        "state_options": _options(RunState),
        "reason_options": _options(FailureReason),
        "run_counts": _counts("run", RunState),
        "task_counts": _counts("task", TaskState),
        "task_state_options": _options(TaskState),
    }
    pages = {}
    for spec in PAGES:
        body = Template(_read("templates", f"{spec.name}.html")).safe_substitute(fragments)
        current = {f"current_{n}": ' aria-current="page"' if n == spec.nav else "" for n in NAV}
        text = layout.substitute(
            title=html.escape(spec.title),
            page=spec.name,
            script=spec.script,
            body=body,
            **current,
        )
        pages[spec.name] = text.encode()
    return pages


def load_assets() -> dict[str, Asset]:
    """Every servable file of ``static/`` by name."""
    assets = {}
    for entry in (resources.files(PACKAGE) / "static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            body = entry.read_bytes()
            etag = hashlib.sha256(body).hexdigest()[:32]
            assets[entry.name] = Asset(body, CONTENT_TYPES[suffix], etag)
    return assets


class Page:
    """One HTML shell."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = HTML_TYPE
        resp.cache_control = [CACHE_CONTROL]
        resp.data = self._body


class RunPage:
    """The run detail shell; a malformed run id is a JSON 400 like everywhere else."""

    def __init__(self, body: bytes) -> None:
        self._page = Page(body)

    def on_get(self, req: falcon.Request, resp: falcon.Response, run_id: str) -> None:
        parse_id(run_id, "run id")
        self._page.on_get(req, resp)


class Static:
    """``/ui/static/{name}``: a packaged asset with its content type and an ETag."""

    def __init__(self, assets: dict[str, Asset]) -> None:
        self._assets = assets

    def on_get(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        asset = self._assets.get(name)
        if asset is None:
            raise json_error(falcon.HTTP_404, f"no asset {name[:80]!r}")
        resp.etag = asset.etag
        resp.cache_control = [CACHE_CONTROL]
        if asset.etag in (req.if_none_match or ()):
            resp.status = falcon.HTTP_304
            return
        resp.content_type = asset.content_type
        resp.data = asset.body


class Home:
    """``/``: redirect to the overview."""

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        resp.status = falcon.HTTP_302
        resp.location = UI_ROOT
        resp.content_type = HTML_TYPE
        resp.data = b""


def add_routes(app: App) -> None:
    """Mount the pages (``/ui``, ``/ui/runs``, ``/ui/runs/{run_id}``, ``/ui/schedules``,
    ``/ui/dead``, ``/ui/processes``, ``/ui/flow``), the assets and the ``/`` redirect on ``app``."""
    pages = render_pages()
    app.add_route("/", Home())
    app.add_route("/ui", Page(pages["overview"]))
    app.add_route("/ui/runs", Page(pages["runs"]))
    app.add_route("/ui/runs/{run_id}", RunPage(pages["run"]))
    app.add_route("/ui/schedules", Page(pages["schedules"]))
    app.add_route("/ui/dead", Page(pages["dead"]))
    app.add_route("/ui/processes", Page(pages["processes"]))
    app.add_route("/ui/flow", Page(pages["flow"]))
    app.add_route("/ui/static/{name}", Static(load_assets()))
