"""The dashboard's shells and assets without a server or a database (flowforge/dashboard/pages.py).

Proven here: every page is rendered with every nav link and exactly its own marked current
(the schedules page too); every script a page loads, and every module a script imports, is a
packaged asset; every name a page script imports from app.js is exported there (a missing one
would stop the module, leaving a blank page); no script writes markup (innerHTML and friends);
the routes serve ``/ui/schedules`` and nothing under it.
"""

from __future__ import annotations

import re

import falcon
import falcon.testing
import pytest

from flowforge.dashboard import pages

NAV_TESTIDS = {
    "overview": "nav-overview",
    "runs": "nav-runs",
    "schedules": "nav-schedules",
    "dead": "nav-dead",
    "processes": "nav-processes",
    "flow": "nav-flow",
}
IMPORT = re.compile(r"import\s*\{([^}]*)\}\s*from\s*\"\./([\w.-]+)\"", re.S)
EXPORT = re.compile(r"export\s+(?:async\s+)?(?:function|const|class|let)\s+([\w$]+)")
#: DOM sinks that parse markup: the pages build nodes with textContent / append() only.
MARKUP_SINKS = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(")


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return {name: body.decode() for name, body in pages.render_pages().items()}


@pytest.fixture(scope="module")
def assets() -> dict[str, pages.Asset]:
    return pages.load_assets()


def test_every_page_has_every_nav_link_and_marks_its_own(rendered: dict[str, str]) -> None:
    assert set(rendered) == {spec.name for spec in pages.PAGES}
    assert "schedules" in rendered and set(pages.NAV) == set(NAV_TESTIDS)
    for spec in pages.PAGES:
        html = rendered[spec.name]
        for nav, testid in NAV_TESTIDS.items():
            link = re.search(rf'<a data-testid="{testid}" href="([^"]+)"([^>]*)>', html)
            assert link is not None, (spec.name, testid)
            assert ("aria-current" in link.group(2)) is (nav == spec.nav), (spec.name, nav)
        assert html.count('aria-current="page"') == 1, spec.name
        assert f'<body data-page="{spec.name}">' in html
        assert "$" not in re.sub(r"\$\{[^}]*\}", "", html), f"{spec.name}: a placeholder is left"


def test_every_script_and_module_a_page_loads_is_an_asset(
    rendered: dict[str, str], assets: dict[str, pages.Asset]
) -> None:
    for spec in pages.PAGES:
        loaded = set(re.findall(r'(?:src|href)="/ui/static/([^"]+)"', rendered[spec.name]))
        assert spec.script in loaded and loaded <= set(assets), (spec.name, loaded - set(assets))
    for name, asset in assets.items():
        if name.endswith(".js"):
            for _, module in IMPORT.findall(asset.body.decode()):
                assert module in assets, (name, module)


def test_page_scripts_import_only_what_app_js_exports_and_write_no_markup(
    assets: dict[str, pages.Asset],
) -> None:
    exported = set(EXPORT.findall(assets["app.js"].body.decode()))
    assert {"scheduleHref", "timeOf", "madeBy", "SCHEDULE_PARAM", "ApiError"} <= exported
    scripts = {n: a.body.decode() for n, a in assets.items() if n.endswith(".js")}
    assert "schedules.js" in scripts
    for name, text in scripts.items():
        for names, module in IMPORT.findall(text):
            wanted = {n.strip() for n in names.split(",") if n.strip()}
            if module == "app.js":
                assert wanted <= exported, (name, wanted - exported)
        for sink in MARKUP_SINKS:
            assert sink not in text, (name, sink)


def test_the_schedules_page_is_routed_and_nothing_below_it() -> None:
    app = falcon.App()
    pages.add_routes(app)
    client = falcon.testing.TestClient(app)
    page = client.simulate_get("/ui/schedules")
    assert page.status_code == 200
    assert page.headers["Content-Type"] == pages.HTML_TYPE
    assert 'data-testid="schedules-table"' in page.text
    assert '<script type="module" src="/ui/static/schedules.js"></script>' in page.text
    assert client.simulate_get("/ui/schedules/ui-pair/0").status_code == 404
    script = client.simulate_get("/ui/static/schedules.js")
    assert script.status_code == 200 and script.headers["Content-Type"].startswith(
        "text/javascript"
    )
