"""OpenAI Completions: POST /v1/completions, relayed to the engine (text or token-id prompts; no
session, no context step), with the caller's cache salt (``pipeline.cache_salt``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentkv.server.edge import EdgeRoute
from agentkv.server.engine.client import EngineUnavailable, relay_stream, unavailable
from agentkv.server.pipeline import cache_salt
from agentkv.server.pipeline.state import app_state

from .chat.protocol import CompletionRequest, forward_body
from .deps import EngineDep, OwnerDep

router = APIRouter(prefix="/v1", route_class=EdgeRoute)


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request, engine: EngineDep, owner: OwnerDep) -> Response:
    cfg = app_state(request).cfg
    body = forward_body(req, cfg.model_name)
    body["cache_salt"] = cache_salt.exact(owner, req.cache_salt, cfg.shared_prefix_cache)
    try:
        if body.get("stream"):
            return await relay_stream(await engine.post_stream("/v1/completions", body))
        status, payload = await engine.post_json("/v1/completions", body)
    except EngineUnavailable as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)
