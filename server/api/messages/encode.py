"""Anthropic Messages responses from the shared turn (``pipeline.turn``): the JSON message, or its
server-sent events as the engine's chunks arrive: ``message_start``;
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` for compaction, thinking
(``thinking_delta``), text (``text_delta``) and tool_use (``input_json_delta``) blocks;
``message_delta`` with ``stop_reason``, ``usage`` and ``context_management``; ``message_stop``.
A stream the engine broke off ends with ``event: error`` instead."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentkv.server.api.ids import new_id
from agentkv.server.engine.client import encode_json
from agentkv.server.errors import anthropic_error_body, status_of
from agentkv.server.metrics import observe_usage
from agentkv.server.pipeline.context import Prepared
from agentkv.server.pipeline.engine_call import Refusal
from agentkv.server.pipeline.turn import Turn


def message_id() -> str:
    return new_id("msg")


def stop_reason(finish: str | None, matched: Any, used_tool: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an OpenAI finish. vLLM names a matched stop string in the
    choice's ``stop_reason``; a forced (named) tool call finishes with ``stop``."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or used_tool:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(openai: dict | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` excludes what the prefix cache supplied
    (``cache_read_input_tokens``); their sum is the prompt."""
    if not openai:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (openai.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": max(0, openai.get("prompt_tokens", 0) - cached), "cache_read_input_tokens": cached,
            "output_tokens": openai.get("completion_tokens", 0)}


def compaction_block(summary: dict) -> dict:
    return {"type": "compaction", "content": summary["content"]}


def compaction_message(model: str, block: dict, usage_: dict, extra: dict) -> dict:
    """A message that holds one compaction block and no reply (``stop_reason: "compaction"``)."""
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": [block],
            "stop_reason": "compaction", "stop_sequence": None, "usage": usage_, **extra}


def _tool_input(arguments: str | None) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message(payload: dict, compaction: dict | None, extra: dict) -> dict:
    """The JSON response for an engine chat completion."""
    choice = payload["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict] = [compaction_block(compaction)] if compaction else []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    calls = msg.get("tool_calls") or []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": _tool_input(c["function"].get("arguments"))} for c in calls]
    if len(content) == (1 if compaction else 0):
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {"id": message_id(), "type": "message", "role": "assistant", "model": payload.get("model"),
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(payload.get("usage")), **extra}


def sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


def error_event(error: dict) -> bytes:
    """``event: error`` for an OpenAI error body (the engine's, or agentkv's engine_unavailable)."""
    inner = error.get("error")
    err = inner if isinstance(inner, dict) else error
    return sse("error", anthropic_error_body(status_of(err), str(err.get("message") or "the engine's stream failed")))


class EventStream:
    """The events of one streamed message. Blocks never interleave: a new kind of delta closes the
    open block and starts the next."""

    def __init__(self, model: str, input_tokens: int):
        self.model, self.input_tokens = model, input_tokens
        self.id = message_id()
        self.blocks: list[dict] = []    # the message's content as the events build it (``content()``)
        self.stop: str | None = None    # the stop reason, once the message is finished
        self.index = -1                 # index of the open (or last) block
        self.open: str | None = None    # its kind: text | thinking | tool_use
        self.tool: int | None = None    # the OpenAI tool-call index it streams
        self.finish: str | None = None
        self.matched: Any = None
        self.used_tool = False
        self.model_blocks = 0

    def start(self) -> bytes:
        return sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})

    def _begin(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        self.blocks.append(json.loads(json.dumps(block)))
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open, self.tool = None, None
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> bytes:
        block, kind = self.blocks[self.index], delta["type"]
        if kind == "text_delta":
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif kind == "input_json_delta":
            block["_json"] = block.get("_json", "") + delta["partial_json"]
        elif kind == "compaction_delta":
            block["content"] = delta["content"]
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def content(self) -> list[dict]:
        """The content blocks of the message streamed so far, as the JSON response would hold them."""
        out = []
        for block in self.blocks:
            block = dict(block)
            if block["type"] == "tool_use":
                block["input"] = _tool_input(block.pop("_json", ""))
            out.append(block)
        return out

    def compaction(self, summary: dict) -> list[bytes]:
        out = self._begin({"type": "compaction", "content": None})
        out.append(self._delta({"type": "compaction_delta", "content": summary["content"]}))
        return out + self._close()

    def chunk(self, chunk: dict) -> list[bytes]:
        """The events for one engine chunk (``chat.completion.chunk`` with a choice)."""
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        out: list[bytes] = []
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            if self.open != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
                self.model_blocks += 1
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if delta.get("content"):
            if self.open != "text":
                out += self._begin({"type": "text", "text": ""})
                self.model_blocks += 1
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for tc in delta.get("tool_calls") or []:
            index, fn = tc.get("index", 0), tc.get("function") or {}
            if tc.get("id") and (self.open != "tool_use" or self.tool != index):
                out += self._begin({"type": "tool_use", "id": tc["id"], "name": fn.get("name") or "", "input": {}})
                self.tool, self.used_tool = index, True
                self.model_blocks += 1
            if fn.get("arguments") and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        if choice.get("finish_reason"):
            self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return out

    def finish_events(self, engine_usage: dict | None, extra: dict, reason: str | None = None) -> list[bytes]:
        """Close the message: an empty text block when the model produced none (as the JSON
        response has), then ``message_delta`` and ``message_stop``."""
        out = self._close()
        if not self.model_blocks and reason is None:
            out += self._begin({"type": "text", "text": ""}) + self._close()
        stop, sequence = (reason, None) if reason else stop_reason(self.finish, self.matched, self.used_tool)
        self.stop = stop
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop, "stop_sequence": sequence},
                                         "usage": usage(engine_usage) if engine_usage else {"output_tokens": 0},
                                         **extra}))
        return out + [sse("message_stop", {"type": "message_stop"})]


def compaction_of(prepared: Prepared) -> dict | None:
    """The summary a ``compact_20260112`` edit wrote in this request (its block leads the answer)."""
    edit = prepared.compact_edit
    return prepared.compaction if edit is not None and edit.compaction_block else None


def refusal(r: Refusal, turn: Turn) -> JSONResponse:
    """The engine's (OpenAI-shaped) refusal in Anthropic's shape: an HTTP error, never a 200
    followed by an error."""
    err = r.body.get("error") if isinstance(r.body, dict) else None
    text = err.get("message") if isinstance(err, dict) else str(r.body)
    return JSONResponse(anthropic_error_body(r.status, str(text)), status_code=r.status,
                        headers={**turn.headers(), **r.headers})


Done = Callable[[str, "list[dict] | None", "str | None"], Awaitable[None]]   # (message id, content, stop reason)


async def paused(turn: Turn, model: str, compaction: dict, stream: bool, done: Done | None = None) -> Response:
    """``pause_after_compaction``: the compaction block alone, no generation."""
    extra = turn.extra([])
    if stream:
        enc = EventStream(model, 0)
        events = [enc.start(), *enc.compaction(compaction), *enc.finish_events(None, extra, reason="compaction")]
        if done:
            await done(enc.id, enc.content(), "compaction")
        return StreamingResponse(iter(events), media_type="text/event-stream", headers=turn.headers())
    body = compaction_message(model, compaction_block(compaction), {"input_tokens": 0, "output_tokens": 0}, extra)
    return await _answered(body, turn, done)


async def _answered(body: dict, turn: Turn, done: Done | None) -> JSONResponse:
    """A whole message, stored first (``done``) where the request is a thread's."""
    if done:
        await done(body["id"], body["content"], body["stop_reason"])
    return JSONResponse(body, headers=turn.headers())


async def complete(turn: Turn, model: str, compaction: dict | None, done: Done | None = None) -> Response:
    out = await turn.complete()
    if isinstance(out, Refusal):
        if done:
            await done("", None, None)
        return refusal(out, turn)
    return await _answered(message(out.payload, compaction, turn.extra(out.server_tool_calls)), turn, done)


async def stream(turn: Turn, model: str, compaction: dict | None, done: Done | None = None) -> Response:
    es = await turn.stream()
    if isinstance(es, Refusal):
        if done:
            await done("", None, None)
        return refusal(es, turn)
    enc = EventStream(model, turn.report["prompt_tokens_after"])

    async def events() -> AsyncIterator[bytes]:
        nonlocal done
        try:
            yield enc.start()
            if compaction:
                for event in enc.compaction(compaction):
                    yield event
            async for chunk in es.chunks():
                if "error" in chunk and not chunk.get("choices"):  # the engine reported an error in-stream
                    yield error_event(chunk)
                    return
                out = enc.chunk(chunk)
                if out:  # one write for the events of one engine chunk
                    yield b"".join(out)
            if es.error is not None:
                yield error_event(es.error)
                return
            observe_usage(es.usage)
            closing = enc.finish_events(es.usage, turn.extra(es.server_tool_calls))
            if done:   # stored before the client sees message_stop: it may continue at once
                await done(enc.id, enc.content(), enc.stop)
                done = None
            for event in closing:
                yield event
        finally:
            if done:   # broken off: nothing to store, the thread lets go
                await done(enc.id, None, None)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**turn.headers(), "Cache-Control": "no-cache"})
