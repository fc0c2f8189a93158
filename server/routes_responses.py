"""OpenAI Responses API: POST /v1/responses, POST /v1/responses/compact, GET /v1/responses/{id}.

Input items become chat messages once (responses_format), the conversation goes through the same
context step as chat (session log before any edit, clearing, summaries; server/context.py) and the
same engine step (server tools, KV reuse; server/engine_stream.py), and the answer is encoded as
Responses output (responses_stream). ``store: true`` keeps each response (its new input and its
output) in the session log database, so ``previous_response_id`` continues it.

Compaction the OpenAI way: ``context_management: [{"type": "compaction", "compact_threshold": N}]``
summarizes once the prompt reaches N tokens and puts a ``compaction`` item first in the output;
``/v1/responses/compact`` and a trailing ``compaction_trigger`` item summarize the whole input and
answer with the compaction item alone. The item stands for the summary message and whatever was kept
word for word (compaction_item.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..compaction.config import Compact
from ..compaction.policy import ContextManagement
from ..compaction.prompt import Message
from ..compaction.summarize import is_summary
from . import kv_reuse, server_tools
from .compaction_item import CompactionSeal, load_key
from .context import Prepared, manage
from .deps import ContextDep, EngineDep, OwnerDep
from .engine_stream import ToolRunner
from .kv_blend import KVBlend
from .errors import APIError
from .responses_format import HEADER_ROLES, ChatTools, new_id, to_chat_tool_choice, to_chat_tools, to_messages
from .responses_stream import Answer, complete, finish_response, replay, stream
from .schemas import require_utf8
from .sessions import SessionRef, session_ref

router = APIRouter(prefix="/v1")


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class CompactionSetting(BaseModel):
    """One entry of OpenAI's ``context_management`` list."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1)


class _Input(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list, max_length=20_000)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    session_id: str | None = None          # agentkv's own


class ResponsesRequest(_Input):
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # agentkv's own (context_management also takes agentkv's {"edits": [...]} form, as on chat):
    context_management: list[CompactionSetting] | ContextManagement | None = None
    server_tools: bool | None = None
    kv_reuse: Literal["recompute", "shift", "blend"] | None = None
    kv_blend: KVBlend | None = None


class CompactRequest(_Input):
    model: str


# Responses fields accepted and echoed in the response, never sent to the engine; other unknown
# fields pass through to it (vLLM's own sampling fields: top_k, seed, structured_outputs, ...).
ECHOED = ("user", "safety_identifier", "service_tier", "prompt_cache_retention", "client_metadata",
          "max_tool_calls")
NOT_SENT = (*ECHOED, "stream_options")


RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


async def _stored(request: Request, owner: str, response_id: str, param: str) -> tuple[str, dict]:
    """(session key, response object) of the caller's stored response; 404 for any other id."""
    found = None
    if RESPONSE_ID.fullmatch(response_id):
        found = await asyncio.to_thread(request.app.state.sessions.log.get_response, response_id)
    if found is None or not found[0].startswith(f"{owner}/"):
        raise APIError(404, f"no stored response {response_id!r}", param=param, code="response_not_found")
    return found


def _seal(state) -> CompactionSeal:
    if getattr(state, "compaction_seal", None) is None:
        state.compaction_seal = CompactionSeal(load_key())
    return state.compaction_seal


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
        key, _ = await _stored(request, owner, req.previous_response_id, "previous_response_id")
        prior = await asyncio.to_thread(log.response_conversation, req.previous_response_id)
        ref = SessionRef(key.split("/", 1)[1], "previous_response_id")
    else:
        ref = session_ref(request.headers, {"session_id": req.session_id, "prompt_cache_key": req.prompt_cache_key,
                                            "metadata": req.metadata})
    seal = _seal(request.app.state)
    converted = to_messages(req.input, lambda item, where: seal.open(owner, item, where), prior)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    conversation = system + converted.messages
    if not _after_header(conversation) and not converted.trigger:
        raise APIError(400, "the request has no input", param="input")
    return ref, prior, converted, conversation


def _explicit_compact(window: int) -> ContextManagement:
    """Everything after the system messages becomes the summary (the user's messages copied into it)."""
    return ContextManagement(edits=[Compact(trigger=0, keep_recent_tokens=0, user_messages_tokens=window // 20,
                                            summary_max_tokens=max(16, min(1024, window // 8)))])


def _policy(req: ResponsesRequest, window: int, compact_at: float) -> tuple[ContextManagement | None, bool]:
    """(the request's policy, whether a compaction item is owed when a summary fires)."""
    cm = req.context_management
    if not isinstance(cm, list):
        return cm, False
    if not cm:
        return None, False
    n = cm[-1].compact_threshold or int(window * compact_at)
    return ContextManagement(edits=[Compact(trigger=n, keep_recent_tokens=int(n * 0.4), user_messages_tokens=n // 15,
                                            summary_max_tokens=max(16, min(1024, window // 8)))]), True


def _check_model(model: str, served: str) -> None:
    """Compaction runs without the engine seeing the request's model: check it as the engine would."""
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _fired(prepared: Prepared) -> dict | None:
    return next((e for e in prepared.report["applied_edits"] if e["type"] == "compact"), None)


async def _compact(request: Request, ctx, owner: str, ref: SessionRef, conversation: list[Message],
                   tools: list | None) -> tuple[Prepared, dict, dict]:
    """(prepared, the compaction item, usage) of compacting the whole conversation."""
    cfg, window = request.app.state.cfg, request.app.state.supervisor.max_model_len
    prepared = await manage(ctx, cfg, window, owner, ref, conversation, tools, _explicit_compact(window))
    if prepared.report.get("failed_edits"):
        raise APIError(503, f"the summary could not be written: {prepared.report['failed_edits'][0]['error']}",
                       code="compaction_failed")
    item = _seal(request.app.state).item(owner, _after_header(prepared.messages))
    fired = _fired(prepared)
    before, written = prepared.report["prompt_tokens_before"], fired["summary_tokens"] if fired else 0
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
    """The chat request for the engine, less its messages."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if k not in NOT_SENT}
    body: dict[str, Any] = {**extra, "model": model}
    if tools.tools:
        body["tools"] = tools.tools
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


class _Turn:
    """What a finished response leaves: its record for ``store: true``. A compaction item in the
    output does not cut the stored chain: the session's view holds the summary, so a continuation by
    ``previous_response_id`` sees the same compacted prompt."""

    def __init__(self, request: Request, req: ResponsesRequest, key: str, prior: list[Message], converted):
        self.log, self.req, self.key = request.app.state.sessions.log, req, key
        # a compaction item in the input starts a new chain: the messages it left are the whole turn
        self.parent = None if converted.compacted else req.previous_response_id
        self.new = converted.messages if converted.compacted else converted.messages[len(prior):]

    async def store(self, response: dict) -> None:
        if not self.req.store or response["status"] not in ("completed", "incomplete"):
            return
        produced = [i for i in response["output"] if i["type"] != "compaction"]
        turn = self.new + to_messages(produced, lambda item, where: []).messages
        await asyncio.to_thread(self.log.put_response, response["id"], self.key, self.parent, turn, response)


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, engine: EngineDep, owner: OwnerDep,
                          ctx: ContextDep) -> Response:
    state = request.app.state
    cfg, window = state.cfg, state.supervisor.max_model_len
    require_utf8(req.model_dump(exclude_unset=True))
    _refuse_unsupported(req)
    model = req.model or cfg.model_name
    tools = to_chat_tools(req.tools)
    body = _chat_body(req, model, tools)              # every field is checked before anything is logged
    with_server_tools = req.server_tools if req.server_tools is not None else cfg.server_tools
    if with_server_tools:
        body["tools"] = server_tools.with_server_tools(body.get("tools"))
    ref, prior, converted, conversation = await _conversation(request, owner, req)
    if converted.trigger:
        _check_model(model, cfg.model_name)
        prepared, item, usage = await _compact(request, ctx, owner, ref, conversation, tools.tools)
        response = _response(req, model)
        response["context_management"] = prepared.report
        finish_response(response, [item], "stop", usage)
        await _Turn(request, req, prepared.key, prior, converted).store(response)
        if req.stream:
            return replay(response, prepared.session_id)
        return JSONResponse(response, headers={"X-Session-Id": prepared.session_id})

    policy, owed = _policy(req, window, cfg.compact_at)
    prepared = await manage(ctx, cfg, window, owner, ref, conversation, tools.tools, policy)
    key, sid = prepared.key, prepared.session_id
    turn = _Turn(request, req, key, prior, converted)
    compaction = _seal(state).item(owner, _after_header(prepared.messages)) if owed and _fired(prepared) else None
    body["messages"] = prepared.messages
    await kv_reuse.attach(cfg, engine, body, key, prepared, req.kv_reuse, req.kv_blend,
                          request.app.state.supervisor.model_path)
    runner = ToolRunner(ctx.sessions.log, key, cfg.max_server_tool_rounds) if with_server_tools else None
    response = _response(req, model)
    response["tools_not_offered"] = tools.not_offered
    answer = Answer(response, [compaction] if compaction else [], tools.namespaces, prepared.report, sid, turn.store)
    return await (stream if req.stream else complete)(engine, body, runner, answer)


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
    return JSONResponse((await _stored(request, owner, response_id, "response_id"))[1])
