"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

/v1/messages goes through the same engine step as /v1/chat/completions (server/engine_stream.py):
the request becomes OpenAI messages once (server/anthropic_format.py), the session log and the
policy work on those, the engine gets the managed view as a chat completion (server-executed
recall/note included), and server/anthropic_stream.py encodes the answer in Anthropic's JSON or
events. ``anthropic-beta`` values and ``?beta=true`` are accepted whatever they are."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..compaction.policy import ContextManagement
from . import kv_reuse, server_tools
from .anthropic_format import chat_request, conversation, engine_message, tools_to_openai
from .anthropic_stream import EventStream, error_event, message, paused
from .context import manage
from .deps import ContextDep, EngineDep, OwnerDep
from .engine_stream import EngineStream, ToolRunner, completion, extra_fields, open_stream, with_usage
from .errors import anthropic_error_body
from .kv_blend import KVBlend
from .metrics import observe_usage
from .proxy import EngineUnavailable, unavailable_message
from .schemas import require_utf8
from .sessions import session_ref

router = APIRouter(prefix="/v1")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class _Conversation(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share. Unknown fields are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=20_000)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # agentkv's own (context_management is also Anthropic's):
    context_management: ContextManagement | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    session_id: str | None = None
    server_tools: bool | None = None
    kv_reuse: Literal["recompute", "shift", "blend"] | None = None   # default: the server's --kv-reuse
    kv_blend: KVBlend | None = None


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


def _error(status: int, payload: Any) -> JSONResponse:
    """The engine's (OpenAI-shaped) refusal in Anthropic's shape."""
    err = payload.get("error") if isinstance(payload, dict) else None
    text = err.get("message") if isinstance(err, dict) else str(payload)
    return JSONResponse(anthropic_error_body(status, str(text)), status_code=status)


def _unavailable(exc: EngineUnavailable) -> JSONResponse:
    return JSONResponse(anthropic_error_body(503, unavailable_message(exc)), status_code=503)


def _conversation(request: Request, body: dict) -> tuple[list, list | None]:
    model_path = request.app.state.supervisor.model_path
    return conversation(body.get("system"), body["messages"], takes_images(model_path)), \
        tools_to_openai(body.get("tools"))


@router.post("/messages")
async def messages(req: MessagesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                   ctx: ContextDep) -> Response:
    cfg = request.app.state.cfg
    body = require_utf8(req.model_dump(exclude_unset=True))
    conv, tools = _conversation(request, body)
    on = req.server_tools if req.server_tools is not None else cfg.server_tools
    engine_tools = server_tools.with_server_tools(tools) if on else tools  # reserved names: 400 before logging
    prepared = await manage(ctx, cfg, request.app.state.supervisor.max_model_len, owner,
                            session_ref(request.headers, {"session_id": req.session_id, **body}), conv, tools,
                            req.context_management, engine_form=engine_message)
    headers = {"X-Session-Id": prepared.session_id}
    model = req.model or cfg.model_name
    compaction = prepared.compaction if prepared.compact_edit and prepared.compact_edit.type == "compact_20260112" \
        else None
    if compaction and prepared.compact_edit.pause_after_compaction:
        if req.stream:
            enc = EventStream(model, 0)
            events = [enc.start(), *enc.compaction(compaction),
                      *enc.finish_events(None, extra_fields(prepared.report, []), reason="compaction")]
            return StreamingResponse(iter(events), media_type="text/event-stream", headers=headers)
        return JSONResponse(paused(model, compaction, extra_fields(prepared.report, [])), headers=headers)
    chat = chat_request(body, model, prepared.messages, engine_tools)
    await kv_reuse.attach(cfg, engine, chat, prepared.key, prepared, req.kv_reuse, req.kv_blend,
                          request.app.state.supervisor.model_path)
    runner = ToolRunner(ctx.sessions.log, prepared.key, cfg.max_server_tool_rounds) if on else None
    if not req.stream:
        try:
            status, payload, calls = await completion(engine, chat, runner, prepared.report)
        except EngineUnavailable as exc:
            return _unavailable(exc)
        if status != 200:
            return _error(status, payload)
        return JSONResponse(message(payload, compaction, extra_fields(prepared.report, calls)), headers=headers)

    chat = with_usage(chat)
    first = await open_stream(engine, chat)
    if isinstance(first, Response):  # refused before anything was sent: an Anthropic error, not a 200
        return _error(first.status_code, json.loads(first.body))
    es = EngineStream(engine, chat, runner, first)
    enc = EventStream(model, prepared.report["prompt_tokens_after"])

    async def events() -> AsyncIterator[bytes]:
        yield enc.start()
        if compaction:
            for event in enc.compaction(compaction):
                yield event
        async for chunk in es.chunks():
            if "error" in chunk and not chunk.get("choices"):  # the engine reported an error in-stream
                yield error_event(chunk)
                return
            events = enc.chunk(chunk)
            if events:  # one write for the events of one engine chunk
                yield b"".join(events)
        if es.error is not None:
            yield error_event(es.error)
            return
        observe_usage(es.usage)
        for event in enc.finish_events(es.usage, extra_fields(prepared.report, es.server_tool_calls)):
            yield event

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})


@router.post("/messages/count_tokens")
async def count_tokens(req: _Conversation, request: Request, _owner: OwnerDep, ctx: ContextDep) -> dict:
    """The prompt's tokens as the engine would get them (chat template and tools included), the
    request's clearing edits applied; nothing is logged. With ``context_management``, also
    ``original_input_tokens`` (before the edits), as Anthropic answers."""
    body = require_utf8(req.model_dump(exclude_unset=True))
    conv, tools = _conversation(request, body)
    after, before = await asyncio.to_thread(ctx.count, conv, tools, req.context_management, engine_message)
    out: dict[str, Any] = {"input_tokens": after}
    if req.context_management is not None:
        out["context_management"] = {"original_input_tokens": before}
    return out
