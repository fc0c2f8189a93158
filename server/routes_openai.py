"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import chat, kv_reuse, server_tools
from .deps import ContextDep, EngineDep, OwnerDep
from .proxy import EngineUnavailable, relay_stream, unavailable
from .schemas import ChatCompletionRequest, CompletionRequest, forward_body
from .context import manage
from .sessions import session_ref

router = APIRouter(prefix="/v1")


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, engine: EngineDep,
                           owner: OwnerDep, ctx: ContextDep) -> Response:
    cfg = request.app.state.cfg
    body = forward_body(req, cfg.model_name)
    with_server_tools = req.server_tools if req.server_tools is not None else cfg.server_tools
    if with_server_tools:  # before the context step: it must count and render what the engine sees
        body["tools"] = server_tools.with_server_tools(body.get("tools"))
    prepared = await manage(ctx, cfg, request.app.state.supervisor.max_model_len, owner,
                            session_ref(request.headers, {"session_id": req.session_id, **body}), body["messages"],
                            body.get("tools"), req.context_management)
    key, sid = prepared.key, prepared.session_id
    body["messages"] = prepared.messages
    await kv_reuse.attach(cfg, engine, body, key, prepared, req.kv_reuse, req.kv_blend,
                          request.app.state.supervisor.model_path)
    runner = chat.ToolRunner(ctx.sessions.log, key, cfg.max_server_tool_rounds) if with_server_tools else None
    handler = chat.stream if body.get("stream") else chat.complete
    response = await handler(engine, body, prepared.report, runner)
    response.headers["X-Session-Id"] = sid
    return response


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request, engine: EngineDep, _: OwnerDep) -> Response:
    body = forward_body(req, request.app.state.cfg.model_name)
    try:
        if body.get("stream"):
            return await relay_stream(await engine.post_stream("/v1/completions", body))
        status, payload = await engine.post_json("/v1/completions", body)
    except EngineUnavailable as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)


@router.get("/models")
async def models(engine: EngineDep, _: OwnerDep) -> Response:
    try:
        status, payload = await engine.get_json("/v1/models")
    except EngineUnavailable as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)
