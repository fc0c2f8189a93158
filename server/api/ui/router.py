"""The sessions page: ``/ui`` (one key's sessions, newest first), ``/ui/sessions/{id}`` (one
session turn by turn, beside its log and the view the model got), their data as JSON under
``/ui/api/``, and signing in (``/ui/login``: the key once, for a cookie; ``ui_auth``).

Server-rendered (Jinja2, every value escaped; the chart is SVG drawn here), no script and nothing
fetched from elsewhere: it works offline. The edge admits ``/ui`` with the API's own headers or the
page's cookie, so a key sees only its own sessions; another key's session answers as one that does
not exist (404), on the page and in its data. ``--no-ui`` leaves all of it out.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from typing import Annotated, Any

import jinja2
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from agentkv.server.api.deps import OwnerDep
from agentkv.server.edge import owner_of_key
from agentkv.server.errors import APIError
from agentkv.server.pipeline.state import app_state
from agentkv.server.ui_auth import MAX_AGE_S, NAME, PATH, UICookie

from . import views
from .chart import chart

router = APIRouter(prefix="/ui", include_in_schema=False)
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                                      "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"}


def _ago(ts: float) -> str:
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s // n} {unit} ago"
    return f"{s} s ago"


def _pct(v: Any, of: Any) -> int:
    return min(100, round(100 * (v or 0) / of)) if of else 0


_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                          autoescape=True, undefined=jinja2.StrictUndefined)
_ENV.filters.update(ago=_ago, pct=_pct, iso=lambda ts: datetime.datetime.fromtimestamp(
    ts, datetime.timezone.utc).isoformat(timespec="seconds"))


def _page(request: Request, name: str, status: int = 200, **values: Any) -> HTMLResponse:
    signed_in = NAME in request.cookies
    html = _ENV.get_template(name).render(model=app_state(request).cfg.model_name, signed_in=signed_in, **values)
    return HTMLResponse(html, status_code=status, headers=HEADERS)


def _cookie(request: Request) -> UICookie:
    cookie = request.app.state.ui_cookie
    assert isinstance(cookie, UICookie)
    return cookie


@router.get("/login")
async def login_form(request: Request) -> HTMLResponse:
    return _page(request, "login.html", error=None)


@router.post("/login")
async def login(request: Request, key: Annotated[str, Form(max_length=1024)]) -> Response:
    cfg = app_state(request).cfg
    owner = owner_of_key(cfg.api_key, f"Bearer {key}", "")
    if owner is None:
        return _page(request, "login.html", status=401, error="That is not one of this server's API keys.")
    out = RedirectResponse("/ui", status_code=303, headers={"Cache-Control": "no-store"})
    https = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
    out.set_cookie(NAME, _cookie(request).make(owner), max_age=MAX_AGE_S, path=PATH, httponly=True,
                   samesite="strict", secure=https)
    return out


@router.post("/logout")
async def logout(request: Request) -> Response:
    out = RedirectResponse("/ui/login", status_code=303, headers={"Cache-Control": "no-store"})
    out.delete_cookie(NAME, path=PATH, httponly=True, samesite="strict")
    return out


@router.get("")
async def sessions_page(request: Request, owner: OwnerDep) -> HTMLResponse:
    rows = await asyncio.to_thread(views.sessions, app_state(request).sessions.log, owner)
    return _page(request, "sessions.html", sessions=rows)


async def _session(request: Request, owner: str, session_id: str) -> dict:
    found = await asyncio.to_thread(views.session, app_state(request).sessions.log, owner, session_id)
    if found is None:
        raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
    return found


@router.get("/sessions/{session_id}")
async def session_page(session_id: str, request: Request, owner: OwnerDep) -> HTMLResponse:
    try:
        s = await _session(request, owner, session_id)
    except APIError as exc:
        return _page(request, "missing.html", status=exc.status, message=exc.message)
    return _page(request, "session.html", s=s, chart=chart(s["turns"]))


@router.get("/api/sessions")
async def sessions_data(request: Request, owner: OwnerDep) -> JSONResponse:
    rows = await asyncio.to_thread(views.sessions, app_state(request).sessions.log, owner)
    return JSONResponse({"object": "list", "data": rows}, headers=HEADERS)


@router.get("/api/sessions/{session_id}")
async def session_data(session_id: str, request: Request, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await _session(request, owner, session_id), headers=HEADERS)
