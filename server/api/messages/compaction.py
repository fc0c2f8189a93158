"""Anthropic compaction on demand (beta ``compact-2026-09-04``): ``compaction: {"type": "summarize",
"instructions"?}`` answers with the conversation as one ``compaction`` block, agentkv's summary,
signed (``stop_reason: "compaction"``); a later request puts that block first and the conversation
goes on from it. The signature is the same sealed form as the Responses API's compaction item,
bound to the API key and to the block's text.

Named errors, as Anthropic's: ``compaction_block_misplaced`` (a signed block that is not the first
block of the conversation), ``compaction_block_ambiguous`` (a signed block beside another signed
one; an unsigned block is plain text to us), ``compaction_signature_invalid`` (altered, forged,
another key's), ``compaction_content_mismatch`` (a genuine signature over other text),
``compaction_incomplete_turn`` (the conversation ends on a tool call not answered),
``compaction_nothing_to_summarize``. ``context_management``,
``stop_sequences`` and a forced ``tool_choice`` do not combine with it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentkv.server.errors import APIError
from agentkv.server.pipeline.compact import compact_now, fired, summary_of
from agentkv.server.pipeline.compaction_item import CompactionSeal
from agentkv.server.pipeline.context import ContextManager, EngineForm, Prepared
from agentkv.server.pipeline.sessions import SessionRef
from agentkv.server.pipeline.state import AppState

from .encode import compaction_message, sse


def _refuse(message: str, error_code: str | None = None, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, error_code=error_code)


def check_request(body: dict) -> None:
    """What a compaction request may not hold, refused before anything is logged."""
    for name in ("context_management", "stop_sequences"):
        if body.get(name):
            raise _refuse(f"compaction cannot be combined with {name}", param=name)
    if (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
        raise _refuse("compaction cannot be combined with a tool_choice that forces a tool", param="tool_choice")
    messages = [m for m in body["messages"] if m["role"] != "system"]
    if not any(m["content"] for m in messages):
        raise _refuse("messages hold no user or assistant content to summarize",
                      "compaction_nothing_to_summarize", "messages")
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and isinstance(last["content"], list) and \
            any(isinstance(b, dict) and b.get("type") == "tool_use" for b in last["content"]):
        raise _refuse("the conversation ends on an assistant turn whose tool calls are not answered",
                      "compaction_incomplete_turn", f"messages.{len(body['messages']) - 1}")


def check_blocks(seal: CompactionSeal, owner: str, messages: list[dict]) -> None:
    """Signed ``compaction`` blocks: genuine, this key's, over their own text, first, alone."""
    signed = []
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    for i, m in enumerate(messages):
        if not isinstance(m["content"], list):
            continue
        for j, b in enumerate(m["content"]):
            if not isinstance(b, dict) or b.get("type") != "compaction":
                continue
            if b.get("signature") is None:  # unsigned: a client's own block, plain text to us
                continue
            signed.append((i, j))
            error = seal.check_text(owner, b.get("content"), b["signature"])
            if error:
                raise _refuse("the compaction block's signature does not verify" if error.endswith("invalid") else
                              "the compaction block's content differs from the text its signature recorded",
                              error, f"messages.{i}.content.{j}")
    if signed and signed[0] != (first, 0):
        i, j = signed[0]
        raise _refuse("a compaction block must be the first block of the conversation", "compaction_block_misplaced",
                      f"messages.{i}.content.{j}")
    if len(signed) > 1:
        raise _refuse("messages hold more than one signed compaction block: send only the one the conversation "
                      "returned last", "compaction_block_ambiguous", "messages")


async def summarize(state: AppState, ctx: ContextManager, owner: str, session: SessionRef, conversation: list[dict],
                    tools: list | None, instructions: str | None, engine_form: EngineForm) -> tuple[Prepared, dict]:
    """(prepared, the signed block) of the conversation summarized whole."""
    prepared = await compact_now(state, ctx, owner, session, conversation, tools, instructions, engine_form)
    summary = summary_of(prepared)
    text = summary["content"] if summary else None
    if not isinstance(text, str) or not text:
        raise APIError(400, "messages hold no user or assistant content to summarize", param="messages",
                       error_code="compaction_nothing_to_summarize")
    return prepared, {"type": "compaction", "content": text, "signature": state.compaction_seal.sign_text(owner, text)}


def respond(model: str, prepared: Prepared, block: dict, stream: bool, headers: dict) -> Response:
    done = fired(prepared)
    usage = {"input_tokens": prepared.report["prompt_tokens_before"],
             "output_tokens": done["summary_tokens"] if done else 0}
    message = compaction_message(model, block, usage, {"context_management": prepared.report})
    if not stream:
        return JSONResponse(message, headers=headers)
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    start.pop("context_management")
    events = [sse("message_start", {"type": "message_start", "message": start}),
              sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
              sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
              sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": "compaction", "stop_sequence": None},
                                    "usage": usage, "context_management": prepared.report}),
              sse("message_stop", {"type": "message_stop"})]
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=headers)
