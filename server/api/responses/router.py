"""OpenAI Responses API: POST /v1/responses, POST /v1/responses/compact, GET /v1/responses/{id}.

Input items become chat messages once (``convert``), the conversation runs the same turn as every
API (``pipeline.turn``: session log before any edit, clearing, summaries, server tools, KV reuse),
and the answer is encoded as Responses output (``encode``). ``store: true`` keeps each response
(its new input and its output) in the session log database (``store``), so
``previous_response_id`` continues it.

Compaction the OpenAI way: ``context_management: [{"type": "compaction", "compact_threshold": N}]``
summarizes once the prompt reaches N tokens and puts a ``compaction`` item first in the output;
``/v1/responses/compact`` and a trailing ``compaction_trigger`` item summarize the whole input and
answer with the compaction item alone. The item stands for the summary message and whatever was kept
word for word (``pipeline.compaction_item``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ....compaction.config import Compact
from ....compaction.policy import ContextManagement, summary_limit
from ....compaction.prompt import Message
from ....compaction.summarize import is_summary
from ...edge import EdgeRoute
from ...errors import APIError
from ...options import require_utf8
from ...pipeline.compact import compact_now, fired
from ...pipeline.compaction_item import seal_of
from ...pipeline.context import Prepared
from ...pipeline.sessions import SessionRef, session_ref
from ...pipeline.turn import TurnInput, prepare_turn
from ..deps import ContextDep, EngineDep, OwnerDep
from . import encode
from ..ids import new_id, take_route
from .convert import HEADER_ROLES, ChatTools, to_chat_tool_choice, to_chat_tools, to_messages
from .protocol import ECHOED, NOT_SENT, CompactRequest, ResponsesRequest, _Input
from .store import StoredTurn, stored

router = APIRouter(prefix="/v1", route_class=EdgeRoute)


def _after_header(messages: list[Message]) -> list[Message]:
    i = 0
    while i < len(messages) and messages[i].get("role") in HEADER_ROLES:
        i += 1
    return messages[i:]


async def _conversation(request: Request, owner: str, req: _Input):
    """(session, previously stored messages, converted input, the conversation the engine sees)."""
    log = request.app.state.sessions.log
    prior: list[Message] = []
    if req.previous_response_id:
        key, _ = await stored(log, owner, req.previous_response_id, "previous_response_id")
        prior = await asyncio.to_thread(log.response_conversation, req.previous_response_id)
        ref = SessionRef(key.split("/", 1)[1], "previous_response_id")
    else:
        ref = session_ref(request.headers, {"session_id": req.session_id, "prompt_cache_key": req.prompt_cache_key,
                                            "metadata": req.metadata})
    seal = seal_of(request.app.state)
    converted = to_messages(req.input, lambda item, where: seal.open(owner, item, where), prior)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    conversation = system + converted.messages
    if not _after_header(conversation) and not converted.trigger:
        raise APIError(400, "the request has no input", param="input")
    return ref, prior, converted, conversation


def _policy(req: ResponsesRequest, window: int, compact_at: float) -> tuple[ContextManagement | None, bool]:
    """(the request's policy, whether a compaction item is owed when a summary fires)."""
    cm = req.context_management
    if not isinstance(cm, list):
        return cm, False
    if not cm:
        return None, False
    n = cm[-1].compact_threshold or int(window * compact_at)
    return ContextManagement(edits=[Compact(trigger=n, keep_recent_tokens=int(n * 0.4), user_messages_tokens=n // 15,
                                            summary_max_tokens=summary_limit(window))]), True


def _check_model(model: str, served: str) -> None:
    """Compaction runs without the engine seeing the request's model: check it as the engine would."""
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def _compact(request: Request, ctx, owner: str, ref: SessionRef, conversation: list[Message],
                   tools: list | None) -> tuple[Prepared, dict, dict]:
    """(prepared, the compaction item, usage) of compacting the whole conversation."""
    prepared = await compact_now(request.app.state, ctx, owner, ref, conversation, tools, param="input")
    item = seal_of(request.app.state).item(owner, _after_header(prepared.messages))
    done = fired(prepared)
    before, written = prepared.report["prompt_tokens_before"], done["summary_tokens"] if done else 0
    usage = {"input_tokens": before, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": written, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": before + written}
    return prepared, item, usage


def _response(req: ResponsesRequest, model: str) -> dict:
    """The Response object as it starts (``in_progress``), echoing the request."""
    extra = req.model_extra or {}
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": None, "metadata": req.metadata or {},
            **{k: extra[k] for k in ECHOED if k in extra}}


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name, bad in (("background", req.background), ("conversation", req.conversation), ("prompt", req.prompt),
                      ("top_logprobs", req.top_logprobs)):
        if bad:
            raise APIError(400, f"{name} is not supported by this server", param=name)


def _chat_body(req: ResponsesRequest, model: str, tools: ChatTools) -> dict:
    """The chat request for the engine, less its messages and tools."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if k not in NOT_SENT}
    body: dict[str, Any] = {**extra, "model": model}
    choice = to_chat_tool_choice(req.tool_choice, tools)
    if choice is not None:
        body["tool_choice"] = choice
    for ours, theirs in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = _response_format(req.text)
    if fmt:
        body["response_format"] = fmt
    return body


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                          ctx: ContextDep) -> Response:
    take_route(request.headers)   # this response's id routes its previous_response_id successors
    state = request.app.state
    cfg, window, log = state.cfg, state.supervisor.max_model_len, state.sessions.log
    require_utf8(req.model_dump(exclude_unset=True))
    _refuse_unsupported(req)
    model = req.model or cfg.model_name
    tools = to_chat_tools(req.tools)
    body = _chat_body(req, model, tools)              # every field is checked before anything is logged
    ref, prior, converted, conversation = await _conversation(request, owner, req)
    if converted.trigger:
        _check_model(model, cfg.model_name)
        prepared, item, usage = await _compact(request, ctx, owner, ref, conversation, tools.tools)
        response = _response(req, model)
        response["context_management"] = prepared.report
        encode.finish_response(response, [item], "stop", usage)
        await StoredTurn(log, req, prepared.key, prior, converted).store(response)
        if req.stream:
            return encode.replay(response, prepared.session_id)
        return JSONResponse(response, headers={"X-Session-Id": prepared.session_id})

    policy, owed = _policy(req, window, cfg.compact_at)
    turn = await prepare_turn(state, engine, ctx, owner, TurnInput(conversation, tools.tools, body, req, ref, policy,
                                                                   param="input"))
    prepared = turn.prepared
    compaction = seal_of(state).item(owner, _after_header(prepared.messages)) if owed and fired(prepared) else None
    response = _response(req, model)
    response["tools_not_offered"] = tools.not_offered
    answer = encode.Answer(response, [compaction] if compaction else [], tools.namespaces,
                           StoredTurn(log, req, prepared.key, prior, converted).store)
    return await (encode.stream if req.stream else encode.complete)(turn, answer)


@router.post("/responses/compact")
async def compact_response(req: CompactRequest, request: Request, _: EngineDep, owner: OwnerDep,
                           ctx: ContextDep) -> Response:
    """``{id, object: "response.compaction", created_at, output: [the user's messages, the compaction
    item], usage}``. The user's messages are there as OpenAI returns them; sent back before the item,
    they are dropped like every item before it (the summary already copies them)."""
    require_utf8(req.model_dump(exclude_unset=True))
    _check_model(req.model, request.app.state.cfg.model_name)
    ref, _prior, converted, conversation = await _conversation(request, owner, req)
    prepared, item, usage = await _compact(request, ctx, owner, ref, conversation, None)
    users = [{"id": new_id("msg"), "type": "message", "status": "completed", "role": "user",
              "content": [{"type": "input_text", "text": m["content"]}]}
             for m in converted.messages if m["role"] == "user" and not is_summary(m)]
    body = {"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
            "output": users + [item], "usage": usage, "context_management": prepared.report}
    return JSONResponse(body, headers={"X-Session-Id": prepared.session_id})


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request, owner: OwnerDep) -> Response:
    """A stored response (``store: true``) of the caller's own."""
    return JSONResponse((await stored(request.app.state.sessions.log, owner, response_id, "response_id"))[1])
