"""The browser playground at `/`: one static page (no build step) over the WebSocket sessions.

The page ships as package data (`static/index.html`). It holds no data, so it is served without
the API key; it asks for the key and sends it on its WebSocket as `?api_key=`.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

router = APIRouter()


@lru_cache(maxsize=1)
def page() -> str:
    return (resources.files("cadenza") / "static" / "index.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, responses={200: {"description": "The playground page."}})
async def playground() -> HTMLResponse:
    # no-store: a page from an older server must not talk to a newer one's protocol.
    return HTMLResponse(page(), headers={"cache-control": "no-store"})


@router.get("/favicon.ico", status_code=204, response_class=Response, responses={204: {"description": "No icon."}})
async def favicon() -> Response:
    return Response(status_code=204)
