"""The chat page (`/`), the dashboard (`/dashboard`) and their assets (`/web/<name>`).

Every byte comes from the package's own files (flashtree/serve/web/, shipped as package data):
hand-written HTML, CSS and JavaScript modules, with no build step and no third-party code, so
the page works offline and what it runs can be read in the repository. The Content-Security-Policy
allows scripts, styles and connections to this origin only: a reference to another host would
fail in the browser rather than leak a conversation.

The page and its assets are public, like /health: they hold no data. With --api-key the page asks
for the key once, keeps it in the browser's local storage and sends it as a bearer token on
every API call it makes, so those calls are guarded exactly as any client's (GuardMiddleware).
Only files of the known kinds directly inside web/ are served, by name: no path reaches
anything else.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import ApiError

WEB_DIR = Path(__file__).with_name("web")
ASSET_PREFIX = "/web/"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new flashtree version's page is the one a reload shows
}


@lru_cache(maxsize=1)
def assets() -> dict[str, Path]:
    """The servable files by name: those of a known content type directly inside web/."""
    return {p.name: p for p in sorted(WEB_DIR.iterdir()) if p.is_file() and p.suffix in CONTENT_TYPES}


def public_paths() -> set[str]:
    """The paths this module serves, all of them open without the API key."""
    return set(PAGES) | {ASSET_PREFIX + name for name in assets()}


def is_public(path: str) -> bool:
    return path in PAGES or path.startswith(ASSET_PREFIX)


def _file(name: str) -> Response:
    path = assets().get(name)
    if path is None:
        raise ApiError(404, f"no such file: {ASSET_PREFIX}{name}", "invalid_request_error", "not_found")
    return Response(path.read_bytes(), media_type=CONTENT_TYPES[path.suffix], headers=HEADERS)


router = APIRouter(include_in_schema=False)


@router.api_route("/", methods=["GET", "HEAD"])
async def chat_page() -> Response:
    return _file(PAGES["/"])


@router.api_route("/dashboard", methods=["GET", "HEAD"])
async def dashboard_page() -> Response:
    return _file(PAGES["/dashboard"])


@router.api_route(ASSET_PREFIX + "{name}", methods=["GET", "HEAD"])
async def asset(name: str) -> Response:
    return _file(name)
