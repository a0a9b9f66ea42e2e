"""The browser chat page (docs/chat-page.md): `GET /` answers a client that accepts
HTML with the page, every other client with the JSON health body; `GET /ui/NAME`
serves the page's files.

The files are package data in serve/webchat/ (plain HTML, CSS and JavaScript: no
build step, nothing fetched from another origin).  Every page response carries a
Content-Security-Policy that allows only this origin's files, so the page keeps
working offline and a model's output can never load or run anything.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from . import errors as E

PAGE = "index.html"
CONTENT_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}
# data: and blob: images are the user's own attachments, shown before they are sent
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a newer ds4mlx's page is picked up at the next load
}


def wants_html(request: web.Request) -> bool:
    """A browser's navigation names text/html in Accept; curl (`*/*`), SDKs and probes do not."""
    for value in request.headers.getall("Accept", []):
        for item in value.split(","):
            media, *params = (p.strip().lower() for p in item.split(";"))
            if media == "text/html" and _quality(params) > 0:
                return True
    return False


def _quality(params: list[str]) -> float:
    """An Accept item's q parameter (1 when absent or unreadable)."""
    for p in params:
        name, _, value = p.partition("=")
        if name.strip() == "q":
            try:
                return float(value)
            except ValueError:
                return 1.0
    return 1.0


def _files() -> dict[str, bytes]:
    folder = resources.files(__package__).joinpath("webchat")
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.name.endswith(tuple(CONTENT_TYPES))}


_CACHE: dict[str, bytes] = {}


def page_file(name: str) -> web.Response:
    """One of the page's files, or the server's 404 for anything else."""
    if not _CACHE:
        _CACHE.update(_files())
    data = _CACHE.get(name)
    if data is None:
        raise E.APIError(404, E.UNKNOWN_ENDPOINT)
    kind = CONTENT_TYPES[name[name.rfind(".") :]]
    return web.Response(body=data, content_type=kind, charset="utf-8", headers=HEADERS)


async def asset(request: web.Request) -> web.Response:
    """GET /ui/NAME: a file of the page (no folders: names only)."""
    return page_file(request.match_info["name"])
