"""Anthropic Messages API, POST /v1/messages, on the same engine and context management.

The body is converted to OpenAI messages for the session log and the policy, the managed view is
converted back and sent to vLLM's own /v1/messages. `context_management` is added to the response
(and to the stream's `message_delta` event)."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..compaction.policy import ContextManagement
from .anthropic_format import to_anthropic, to_openai, tools_to_openai
from .deps import ContextDep, EngineDep, OwnerDep
from .proxy import unavailable, unavailable_message
from .schemas import require_utf8
from .context import manage
from .sessions import session_ref

router = APIRouter(prefix="/v1")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=20_000)
    max_tokens: int = Field(..., ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    stream: bool = False
    context_management: ContextManagement | None = None
    session_id: str | None = None


async def _stream(resp: httpx.Response, report: dict):
    """Relay Anthropic SSE events; the `message_delta` event gains `context_management`."""
    buf = b""
    try:
        async for chunk in resp.aiter_raw():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                text = event.decode()
                if "event: message_delta" in text:
                    lines = text.splitlines()
                    for i, line in enumerate(lines):
                        if line.startswith("data:"):
                            data = json.loads(line[5:])
                            data["context_management"] = report
                            lines[i] = "data: " + json.dumps(data)
                    text = "\n".join(lines)
                yield (text + "\n\n").encode()
        if buf:
            yield buf
    except httpx.TransportError as exc:  # the engine went away mid-stream: Anthropic's error event
        err = {"type": "error", "error": {"type": "overloaded_error",
                                          "message": unavailable_message(exc)}}
        yield f"event: error\ndata: {json.dumps(err)}\n\n".encode()
    finally:
        await resp.aclose()


@router.post("/messages")
async def messages(req: MessagesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                   ctx: ContextDep) -> Response:
    cfg = request.app.state.cfg
    body = require_utf8(req.model_dump(exclude_unset=True, exclude={"context_management", "session_id"}))
    body["model"] = req.model or cfg.model_name
    conversation = to_openai(body.get("system"), body["messages"])
    prepared = await manage(ctx, cfg, request.app.state.supervisor.max_model_len, owner,
                            session_ref(request.headers, {"session_id": req.session_id, **body}), conversation,
                            tools_to_openai(body.get("tools")), req.context_management)
    sid = prepared.session_id
    system, body["messages"] = to_anthropic(prepared.messages)
    if system:
        body["system"] = system
    try:
        if body.get("stream"):
            resp = await engine.post_stream("/v1/messages", body)
            if resp.status_code != 200:
                await resp.aread()
                await resp.aclose()
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            return StreamingResponse(_stream(resp, prepared.report), media_type="text/event-stream",
                                     headers={"X-Session-Id": sid})
        status, payload = await engine.post_json("/v1/messages", body)
    except httpx.TransportError as exc:
        return unavailable(exc)
    if status == 200:
        payload["context_management"] = prepared.report
    return JSONResponse(payload, status_code=status, headers={"X-Session-Id": sid})
