"""OpenAI Chat Completions: POST /v1/chat/completions, one shared turn (``pipeline.turn``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentkv.server.api.deps import ContextDep, EngineDep, OwnerDep
from agentkv.server.edge import EdgeRoute
from agentkv.server.pipeline.state import app_state
from agentkv.server.pipeline.turn import TurnInput, prepare_turn, session_of

from . import encode
from .protocol import ChatCompletionRequest, forward_body

router = APIRouter(prefix="/v1", route_class=EdgeRoute)


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, engine: EngineDep,
                           owner: OwnerDep, ctx: ContextDep) -> Response:
    state = app_state(request)
    body = forward_body(req, state.cfg.model_name)
    messages, tools = body.pop("messages"), body.pop("tools", None)
    turn = await prepare_turn(state, engine, ctx, owner, TurnInput(
        messages, tools, body, req, session_of(request.headers, req, body), req.context_management))
    return await (encode.stream if req.stream else encode.complete)(turn)
