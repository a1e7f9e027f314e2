"""`GET /` and `GET /ui/<file>`: the page's static files, shipped in the package (no build step,
nothing fetched from elsewhere). They are read once, by name from a fixed list (no path from
the request ever reaches the filesystem), and sent with a Content-Security-Policy that runs
only this server's scripts: even a reply the page failed to escape could not execute.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, content type) of every file in the package's static/ folder."""
    folder = resources.files("deepinfer.frontend.ui") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if entry.is_file() and suffix in CONTENT_TYPES:
            files[entry.name] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    return files


def ui_routes() -> list[Route]:
    files = _static_files()

    def respond(name: str) -> Response:
        if name not in files:
            return Response("not found", status_code=404, media_type="text/plain")
        body, content_type = files[name]
        return Response(body, media_type=content_type, headers=HEADERS)

    async def index(request: Request) -> Response:
        return respond("index.html")

    async def static(request: Request) -> Response:
        return respond(request.path_params["name"])

    return [Route("/", index, methods=["GET"]),
            Route("/ui/{name}", static, methods=["GET"])]
