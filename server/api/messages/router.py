"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

/v1/messages runs the same turn as every API (``pipeline.turn``): the request becomes OpenAI
messages once (``convert``), the session log and the policy work on those, the engine gets the
managed view as a chat completion (server-executed recall/note included), and ``encode`` answers
in Anthropic's JSON or events. ``anthropic-beta`` values and ``?beta=true`` are accepted whatever
they are."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentkv.compaction.edit_kinds.compact import Compact
from agentkv.server.api.deps import ContextDep, EngineDep, OwnerDep
from agentkv.server.api.ids import take_route
from agentkv.server.edge import EdgeRoute
from agentkv.server.errors import APIError
from agentkv.server.options import require_utf8
from agentkv.server.pipeline.state import AppState, app_state
from agentkv.server.pipeline.turn import TurnInput, prepare_turn, session_of

from . import compaction as on_demand
from . import encode, threads
from .convert import chat_request, conversation, engine_message, offered_tools, tools_to_openai
from .protocol import MessagesRequest, _Conversation

router = APIRouter(prefix="/v1", route_class=EdgeRoute)


@functools.lru_cache(maxsize=8)
def takes_images(model_path: str | None) -> bool:
    """Whether the served model reads images (its config has a vision tower)."""
    if not model_path:
        return False
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
    except (OSError, ValueError):
        return False


def _conversation(state: AppState, body: dict) -> tuple[list, list | None]:
    model_path = state.supervisor.model_path
    return conversation(body.get("system"), body["messages"], takes_images(model_path)), \
        tools_to_openai(offered_tools(body.get("tools"), body["messages"]))


@router.post("/messages")
async def messages(req: MessagesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                   ctx: ContextDep) -> Response:
    take_route(request.headers)   # this message's id routes the thread's continues
    state = app_state(request)
    body = require_utf8(req.model_dump(exclude_unset=True))
    if req.thread is not None and req.compaction is not None:
        raise APIError(400, "thread cannot be combined with compaction: compact the conversation, then create a "
                            "thread from the compaction block",
                       param="compaction", error_code="thread_unsupported_request")
    thread = await threads.resume(state.sessions.log, owner, body)     # a continue: the body made whole
    held = threads.claim(state.sessions.log, thread)                   # from here on, released on every path
    try:
        on_demand.check_blocks(state.compaction_seal, owner, body["messages"])
        if req.compaction is not None:
            on_demand.check_request(body)
        conv, tools = _conversation(state, body)
        model = req.model or state.cfg.model_name
        session = thread.session if thread and thread.session else session_of(request.headers, req, body)
        if req.compaction is not None:
            prepared, block = await on_demand.summarize(state, ctx, owner, session, conv, tools,
                                                        req.compaction.instructions, engine_message)
            return on_demand.respond(model, prepared, block, req.stream, {"X-Session-Id": prepared.session_id})
        turn = await prepare_turn(state, engine, ctx, owner, TurnInput(
            conv, tools, chat_request(body, model), req, session, req.context_management, engine_message,
            api="messages"))
        if held:
            held.session_key = turn.prepared.key
        done = held.done if held else None
        compaction = encode.compaction_of(turn.prepared)
        edit = turn.prepared.compact_edit   # a Compact where it wrote a compaction block
        if compaction and isinstance(edit, Compact) and edit.pause_after_compaction:
            return await encode.paused(turn, model, compaction, req.stream, done)
        return await (encode.stream if req.stream else encode.complete)(turn, model, compaction, done)
    except BaseException:
        if held:
            held.release()
        raise


@router.post("/messages/count_tokens")
async def count_tokens(req: _Conversation, request: Request, _owner: OwnerDep, ctx: ContextDep) -> dict:
    """The prompt's tokens as the engine would get them (chat template and tools included), the
    request's clearing edits applied; nothing is logged. With ``context_management``, also
    ``original_input_tokens`` (before the edits), as Anthropic answers."""
    body = require_utf8(req.model_dump(exclude_unset=True))
    conv, tools = _conversation(app_state(request), body)
    after, before = await asyncio.to_thread(ctx.count, _owner, conv, tools, req.context_management, engine_message)
    out: dict[str, Any] = {"input_tokens": after}
    if req.context_management is not None:
        out["context_management"] = {"original_input_tokens": before}
    return out
