"""The page's routes: `/` and its files with a Content-Security-Policy that runs only this
server's scripts, nothing outside the shipped folder, nothing at all with --no-ui."""

from __future__ import annotations

from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState
from deepinfer.frontend.ui.routes import HEADERS


def client(ui: bool) -> TestClient:
    return TestClient(build_app(ServerState(8, ui=ui), lambda: None))  # no lifespan: no engine


def test_the_page_and_its_files_are_served_with_a_strict_policy():
    http = client(ui=True)
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("main.js", "text/javascript"), ("markdown.js", "text/javascript"),
                       ("style.css", "text/css")):
        r = http.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert r.headers["x-content-type-options"] == "nosniff"


def test_only_the_shipped_files_are_served():
    http = client(ui=True)
    for path in ("/ui/nothing.js", "/ui/..%2Froutes.py", "/ui/__init__.py", "/ui/"):
        assert http.get(path).status_code == 404, path


def test_no_ui_serves_no_page():
    http = client(ui=False)
    assert http.get("/").status_code == 404
    assert http.get("/ui/main.js").status_code == 404
