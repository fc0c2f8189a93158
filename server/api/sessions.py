"""Read-only access to a caller's own session log: /v1/sessions/{id} and its messages.

A session is addressed by the id the chat routes return in ``X-Session-Id``; it is looked up under
the caller's key only, so another key's session answers 404, exactly like one that does not exist.
Works while the engine is down (the log does not need it)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request

from agentkv.compaction.log.session_log import SessionLog
from agentkv.server.errors import APIError
from agentkv.server.pipeline.sessions import ViewState, session_key
from agentkv.server.pipeline.state import app_state

from .deps import OwnerDep

router = APIRouter(prefix="/v1/sessions")


async def _lookup(request: Request, owner: str, session_id: str) -> tuple[SessionLog, str, str, int]:
    """(the log, the session's storage key, its public id, its message count); 404 for none."""
    key, sid = session_key(owner, session_id)
    log = app_state(request).sessions.log
    count = await asyncio.to_thread(log.count, key)
    if count == 0:
        raise APIError(404, f"no session {sid!r}", param="session_id", code="session_not_found")
    return log, key, sid, count


@router.get("/{session_id}")
async def session(session_id: str, request: Request, owner: OwnerDep) -> dict:
    log, key, sid, count = await _lookup(request, owner, session_id)
    state = ViewState.load(await asyncio.to_thread(log.get_state, key))
    notes = await asyncio.to_thread(log.notes, key)
    return {"id": sid, "object": "session", "messages": count,
            "view": {"cleared": len(state.replaced),
                     "summarized": state.summary_end - state.summary_start if state.summary else 0},
            "notes": [{"kind": k, "text": t} for k, t in notes]}


@router.get("/{session_id}/messages")
async def messages(session_id: str, request: Request, owner: OwnerDep,
                   offset: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)) -> dict:
    """The full log, as received, in order (cleared and summarized messages included)."""
    log, key, sid, count = await _lookup(request, owner, session_id)
    page = await asyncio.to_thread(log.history, key, offset, limit)
    return {"object": "list", "session_id": sid, "data": page, "total": count,
            "has_more": offset + len(page) < count}
