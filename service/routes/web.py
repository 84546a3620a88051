"""GET /: the drawing page (plain HTML/JS/CSS shipped in `service/static`)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.guard import PAGE_HEADERS
from service.policy import policy

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"

router = APIRouter(tags=["web"])


def static_files() -> StaticFiles:
    """The page's scripts and styles (open like the page: it asks for the key itself)."""
    return policy(public=True)(StaticFiles(directory=STATIC_DIR))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
@policy(public=True)
def page() -> HTMLResponse:
    return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"),
                        headers=PAGE_HEADERS)
