"""The web console: static files under ``/console/``, served by the management port itself.

The pages hold no data and no secret: the browser's script reads everything from ``/api`` with the
credentials the user typed in (kept in the tab's session storage, sent as HTTP Basic on each call). Hence the
files are open, and every answer carries a strict Content-Security-Policy (scripts and styles from this
origin only, no inline code, no framing) so that a name shown in a page can never run as code.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

CONSOLE_PATH = "/console"
FILES = Path(__file__).parent / "console"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The files a browser may ask for, by URL path below /console/: nothing else of the package is served.
SERVED = {
    "": ("index.html", "text/html"),
    "console.js": ("console.js", "text/javascript"),
    "console.css": ("console.css", "text/css"),
    "vendor/uplot/uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "vendor/uplot/uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
    "vendor/uplot/LICENSE": ("vendor/uplot/LICENSE", "text/plain"),
}


def is_console_path(path: str) -> bool:
    return path == CONSOLE_PATH or path.startswith(CONSOLE_PATH + "/")


async def _redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(CONSOLE_PATH + "/")


async def _file(request: web.Request) -> web.StreamResponse:
    entry = SERVED.get(request.match_info["file"])
    if entry is None:
        return web.Response(status=404, text="not found", headers=SECURITY_HEADERS)
    name, content_type = entry
    body = (FILES / name).read_bytes()  # small files, read per request: a new wheel needs no restart of a cache
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS)


def add_console(app: web.Application) -> None:
    app.router.add_get(CONSOLE_PATH, _redirect)
    app.router.add_get(CONSOLE_PATH + "/{file:.*}", _file)
