"""Compaction the OpenAI way, for the Responses API.

``context_management: [{"type": "compaction", "compact_threshold": N}]`` summarizes once the prompt
reaches N tokens and puts a ``compaction`` item first in the output (``policy``, ``head``);
``/v1/responses/compact`` (``compact``) and a trailing ``compaction_trigger`` item (``triggered``)
summarize the whole input and answer with the compaction item alone. The item stands for the summary
message and whatever was kept word for word (``pipeline.compaction_item``).
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, Response

from agentkv.compaction.edit_kinds.compact import Compact
from agentkv.compaction.policy import ContextManagement, summary_limit
from agentkv.compaction.summarize import is_summary
from agentkv.server.api.ids import new_id
from agentkv.server.errors import APIError
from agentkv.server.pipeline.compact import compact_now, fired
from agentkv.server.pipeline.compaction_item import CompactionSeal
from agentkv.server.pipeline.context import ContextManager, Prepared
from agentkv.server.pipeline.state import AppState

from . import encode
from .convert import ChatRequest, Conversation, after_header
from .protocol import ResponsesRequest
from .store import StoredTurn


def policy(req: ResponsesRequest, window: int, compact_at: float) -> tuple[ContextManagement | None, bool]:
    """(the request's policy, whether a compaction item is owed when a summary fires)."""
    cm = req.context_management
    if not isinstance(cm, list):
        return cm, False
    if not cm:
        return None, False
    n = cm[-1].compact_threshold or int(window * compact_at)
    return ContextManagement(edits=[Compact(trigger=n, keep_recent_tokens=int(n * 0.4), user_messages_tokens=n // 15,
                                            summary_max_tokens=summary_limit(window))]), True


def head(seal: CompactionSeal, owner: str, prepared: Prepared, owed: bool) -> list[dict]:
    """The items before the model's: the compaction item, when one is owed and a summary fired."""
    return [seal.item(owner, after_header(prepared.messages))] if owed and fired(prepared) else []


def check_model(model: str, served: str) -> None:
    """Compaction runs without the engine seeing the request's model: check it as the engine would."""
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def _compact(state: AppState, ctx: ContextManager, owner: str, conv: Conversation,
                   tools: list[dict] | None) -> tuple[Prepared, dict, dict]:
    """(prepared, the compaction item, usage) of compacting the whole conversation."""
    prepared = await compact_now(state, ctx, owner, conv.ref, conv.messages, tools, param="input")
    item = state.compaction_seal.item(owner, after_header(prepared.messages))
    done = fired(prepared)
    before, written = prepared.report["prompt_tokens_before"], done["summary_tokens"] if done else 0
    usage = {"input_tokens": before, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": written, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": before + written}
    return prepared, item, usage


async def triggered(state: AppState, ctx: ContextManager, owner: str, req: ResponsesRequest, chat: ChatRequest,
                    conv: Conversation) -> Response:
    """The answer to an input ending with ``compaction_trigger``: a Response whose output is the
    compaction item alone (stored as any response is), JSON or its events."""
    check_model(chat.model, state.cfg.model_name)
    prepared, item, usage = await _compact(state, ctx, owner, conv, chat.tools.tools)
    response = encode.start(req, chat.model)
    response["context_management"] = prepared.report
    encode.finish_response(response, [item], "stop", usage)
    await StoredTurn(state.sessions.log, req, prepared.key, conv).store(response)
    if req.stream:
        return encode.replay(response, prepared.session_id)
    return JSONResponse(response, headers={"X-Session-Id": prepared.session_id})


async def compact(state: AppState, ctx: ContextManager, owner: str, conv: Conversation) -> Response:
    """``{id, object: "response.compaction", created_at, output: [the user's messages, the compaction
    item], usage}``. The user's messages are there as OpenAI returns them; sent back before the item,
    they are dropped like every item before it (the summary already copies them)."""
    prepared, item, usage = await _compact(state, ctx, owner, conv, None)
    users = [{"id": new_id("msg"), "type": "message", "status": "completed", "role": "user",
              "content": [{"type": "input_text", "text": m["content"]}]}
             for m in conv.converted.messages if m["role"] == "user" and not is_summary(m)]
    body = {"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
            "output": users + [item], "usage": usage, "context_management": prepared.report}
    return JSONResponse(body, headers={"X-Session-Id": prepared.session_id})
