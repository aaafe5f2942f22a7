"""The status page (GET /status): what an operator opens in a browser.

The page is three static files (router/static/: HTML, CSS, JS; no build step, nothing from
outside) that fetch GET /admin/status (router/status_model.py's ClusterStatus) every ~2 s and
draw it with DOM calls that insert text only, never markup, so an instance id or an error message
cannot become script. A Content-Security-Policy that allows only this origin's script and style
files backs that up. The page's requests carry the admin credential as a browser does: router/admin_auth.py.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import Response

from router.admin_auth import require_admin
from security.credentials import ClusterCredentials

PAGE_FILES = {"status.html": "text/html", "status.css": "text/css", "status.js": "text/javascript"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}




def _page_file(name: str) -> bytes:
    return resources.files("router").joinpath("static", name).read_bytes()


def add_status_page(app: FastAPI, credentials: ClusterCredentials) -> None:
    """Add GET /status (the page) and GET /status/<file> (its stylesheet and script)."""
    files = {name: _page_file(name) for name in PAGE_FILES}  # read once: a missing file fails at start
    routes = APIRouter(dependencies=[Depends(require_admin(credentials))])

    def page_file(name: str) -> Response:
        return Response(files[name], media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

    @routes.get("/status", include_in_schema=False)
    async def status_page() -> Response:
        return page_file("status.html")

    @routes.get("/status/status.css", include_in_schema=False)
    async def status_style() -> Response:
        return page_file("status.css")

    @routes.get("/status/status.js", include_in_schema=False)
    async def status_script() -> Response:
        return page_file("status.js")

    app.include_router(routes)
