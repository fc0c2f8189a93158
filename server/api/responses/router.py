"""OpenAI Responses API: POST /v1/responses, POST /v1/responses/compact, GET /v1/responses/{id}.

The request becomes chat terms once (``convert``: its fields, tools and input items; the messages a
``previous_response_id`` left come from ``store``), the conversation runs the same turn as every API
(``pipeline.turn``: session log before any edit, clearing, summaries, server tools, KV reuse), and
the answer is encoded as Responses output (``encode``). ``store: true`` keeps each response (its new
input and its output) in the session log database (``store``), so ``previous_response_id``
continues it. Compaction (a threshold, ``compaction_trigger``, ``/v1/responses/compact``):
``compaction``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentkv.server.api.deps import ContextDep, EngineDep, OwnerDep
from agentkv.server.api.ids import take_route
from agentkv.server.edge import EdgeRoute
from agentkv.server.options import require_utf8
from agentkv.server.pipeline.state import app_state
from agentkv.server.pipeline.turn import TurnInput, prepare_turn

from . import compaction, encode
from .convert import conversation, to_chat
from .protocol import CompactRequest, ResponsesRequest
from .store import StoredTurn, continued, stored

router = APIRouter(prefix="/v1", route_class=EdgeRoute)


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                          ctx: ContextDep) -> Response:
    take_route(request.headers)   # this response's id routes its previous_response_id successors
    state = app_state(request)
    require_utf8(req.model_dump(exclude_unset=True))
    chat = to_chat(req, state.cfg.model_name)              # every field is checked before anything is logged
    ref, prior = await continued(state.sessions.log, owner, req, request.headers)
    conv = conversation(req, ref, prior, state.compaction_seal, owner)
    if conv.converted.trigger:
        return await compaction.triggered(state, ctx, owner, req, chat, conv)
    policy, owed = compaction.policy(req, state.supervisor.max_model_len, state.cfg.compact_at)
    turn = await prepare_turn(state, engine, ctx, owner, TurnInput(conv.messages, chat.tools.tools, chat.body, req,
                                                                   conv.ref, policy, param="input", api="responses"))
    head = compaction.head(state.compaction_seal, owner, turn.prepared, owed)
    answer = encode.answer_for(req, chat, head, StoredTurn(state.sessions.log, req, turn.prepared.key, conv).store)
    return await (encode.stream if req.stream else encode.complete)(turn, answer)


@router.post("/responses/compact")
async def compact_response(req: CompactRequest, request: Request, _: EngineDep, owner: OwnerDep,
                           ctx: ContextDep) -> Response:
    """The input compacted: its user messages and the compaction item (``compaction.compact``)."""
    state = app_state(request)
    require_utf8(req.model_dump(exclude_unset=True))
    compaction.check_model(req.model, state.cfg.model_name)
    ref, prior = await continued(state.sessions.log, owner, req, request.headers)
    return await compaction.compact(state, ctx, owner, conversation(req, ref, prior, state.compaction_seal, owner))


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request, owner: OwnerDep) -> Response:
    """A stored response (``store: true``) of the caller's own."""
    return JSONResponse((await stored(app_state(request).sessions.log, owner, response_id, "response_id"))[1])
