"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .deps import Authorized, EngineDep
from .proxy import relay_stream, unavailable
from .schemas import ChatCompletionRequest, CompletionRequest, forward_body

router = APIRouter(prefix="/v1", dependencies=[Authorized])


async def _forward(engine, path: str, body: dict) -> Response:
    try:
        if body.get("stream"):
            return await relay_stream(await engine.post_stream(path, body))
        status, payload = await engine.post_json(path, body)
    except httpx.TransportError as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, engine: EngineDep) -> Response:
    return await _forward(engine, "/v1/chat/completions", forward_body(req, request.app.state.cfg.model_name))


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request, engine: EngineDep) -> Response:
    return await _forward(engine, "/v1/completions", forward_body(req, request.app.state.cfg.model_name))


@router.get("/models")
async def models(engine: EngineDep) -> Response:
    try:
        status, payload = await engine.get_json("/v1/models")
    except httpx.TransportError as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)
