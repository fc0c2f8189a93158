"""OpenAI Responses encoding of the shared turn (``pipeline.turn``): the Response object (as it
starts, echoing the request, and as it ends), output items built from chat deltas, and the
server-sent event sequence.

Streamed, events go out as the engine's chunks arrive, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
its content (``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done``; ``response.function_call_arguments.delta`` ... ``.done``; reasoning
as ``response.reasoning_text.delta`` ... ``.done``), ``response.output_item.done``; and last
``response.completed`` (``response.incomplete`` when the output hit its token limit, ``response.failed``
when the engine broke off). A non-streamed response is the same builder fed the whole message at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentkv.server.api.ids import new_id
from agentkv.server.engine.client import encode_json
from agentkv.server.metrics import observe_usage
from agentkv.server.pipeline.engine_call import Refusal
from agentkv.server.pipeline.turn import Turn

from .convert import ChatRequest
from .protocol import ECHOED, ResponsesRequest

EventFields = dict[str, Any]


def start(req: ResponsesRequest, model: str) -> dict:
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


def to_usage(usage: dict | None) -> dict | None:
    """Chat usage as Responses usage. ``cache_write_tokens``: the prompt tokens the engine computed
    (vLLM's prefix cache keeps every prompt block it computes)."""
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": max(0, prompt - cached)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


class OutputBuilder:
    """Builds the ``output`` items of a response from chat deltas; ``feed`` and ``close`` return the
    events (type, fields) that describe each step. Items: reasoning, message, function_call."""

    def __init__(self, namespaces: dict[str, tuple[str, str]], first_index: int = 0):
        self.namespaces = namespaces
        self.items: list[dict] = []
        self.first_index = first_index
        self._open: dict | None = None          # the item being streamed
        self._calls: dict[int, dict] = {}       # chat tool-call index -> its function_call item

    def _index(self, item: dict) -> int:
        return self.first_index + self.items.index(item)

    def _start(self, item: dict) -> list[tuple[str, EventFields]]:
        events = self.close()
        self.items.append(item)
        self._open = item
        added = {**item, "content": []} if item["type"] in ("message", "reasoning") else dict(item)
        out = [("response.output_item.added", {"output_index": self._index(item), "item": added})]
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            out.append(("response.content_part.added", {"item_id": item["id"], "output_index": self._index(item),
                                                        "content_index": 0, "part": dict(item["content"][0])}))
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
            out.append(("response.content_part.added", {"item_id": item["id"], "output_index": self._index(item),
                                                        "content_index": 0, "part": dict(item["content"][0])}))
        return events + out

    def close(self) -> list[tuple[str, EventFields]]:
        """Finish the open item (if any)."""
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self._index(item)}
        out: list[tuple[str, EventFields]] = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [("response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": dict(part)})]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [("response.reasoning_text.done", {**at, "content_index": 0, "text": part["text"]}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": dict(part)})]
        else:
            out.append(("response.function_call_arguments.done",
                        {**at, "name": item["name"], "arguments": item["arguments"]}))
        item["status"] = "completed"
        out.append(("response.output_item.done", {"output_index": at["output_index"], "item": item}))
        return out

    def feed(self, delta: dict) -> list[tuple[str, EventFields]]:
        """One chat delta (``reasoning`` / ``reasoning_content``, ``content``, ``tool_calls``)."""
        out: list[tuple[str, EventFields]] = []
        thought = delta.get("reasoning") or delta.get("reasoning_content")
        if thought:
            item = self._open
            if item is None or item["type"] != "reasoning":
                item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "encrypted_content": None}
                out += self._start(item)   # item is now the open one
            item["content"][0]["text"] += thought
            out.append(("response.reasoning_text.delta", {"item_id": item["id"], "output_index": self._index(item),
                                                          "content_index": 0, "delta": thought}))
        if delta.get("content"):
            item = self._open
            if item is None or item["type"] != "message":
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
                out += self._start(item)   # item is now the open one
            item["content"][0]["text"] += delta["content"]
            out.append(("response.output_text.delta", {"item_id": item["id"], "output_index": self._index(item),
                                                       "content_index": 0, "delta": delta["content"], "logprobs": []}))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            item = self._calls.get(tc.get("index", 0))
            if item is None:
                flat = fn.get("name") or ""
                space, name = self.namespaces.get(flat, (None, flat))
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": tc.get("id") or new_id("call"), "name": name, "arguments": ""}
                if space:
                    item["namespace"] = space
                self._calls[tc.get("index", 0)] = item
                out += self._start(item)
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(("response.function_call_arguments.delta",
                            {"item_id": item["id"], "output_index": self._index(item), "delta": fn["arguments"]}))
        return out

    def finish(self) -> list[tuple[str, EventFields]]:
        """Close the open item; an answer with no output at all gets an empty message."""
        out = self.close()
        if not self.items:
            out = self._start({"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"})
            out += self.close()
        return out


def whole_message_delta(message: dict) -> dict:
    """A non-streamed chat message as one delta for ``OutputBuilder.feed``."""
    return {"reasoning": message.get("reasoning") or message.get("reasoning_content"),
            "content": message.get("content"),
            "tool_calls": [{**c, "index": i} for i, c in enumerate(message.get("tool_calls") or [])]}


class EventStream:
    """Numbers events and encodes them as server-sent events (``event:`` and ``data:`` lines)."""

    def __init__(self) -> None:
        self.sequence = 0

    def encode(self, kind: str, fields: EventFields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


def finish_response(response: dict, items: list[dict], finish_reason: str | None, usage: dict | None,
                    error: dict | None = None) -> str:
    """Fill in the final state of ``response``; returns the closing event type."""
    response["output"] = items
    response["usage"] = usage
    if error is not None:
        response["status"] = "failed"
        response["error"] = error
        return "response.failed"
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        return "response.incomplete"
    response["status"] = "completed"
    response["completed_at"] = int(time.time())
    return "response.completed"


def _failure(error: dict) -> dict:
    err = error.get("error", error)
    return {"code": "server_error", "message": err.get("message") or "the response failed"}


@dataclass
class Answer:
    """A response to answer: the Response object (``in_progress``, echoing the request), the items
    that come before the model's (a compaction item), how namespaced tool names map back, and what
    to do with the finished response (store it)."""

    response: dict
    head: list[dict]
    namespaces: dict[str, tuple[str, str]]
    done: Callable[[dict], Awaitable[None]]


def answer_for(req: ResponsesRequest, chat: ChatRequest, head: list[dict],
               done: Callable[[dict], Awaitable[None]]) -> Answer:
    """The answer to ``req`` to come: the model's items after those of ``head``; ``done`` gets the
    finished response."""
    response = start(req, chat.model)
    response["tools_not_offered"] = chat.tools.not_offered
    return Answer(response, head, chat.tools.namespaces, done)


def refusal(r: Refusal, turn: Turn) -> JSONResponse:
    """The engine's refusal before any answer, in OpenAI's error shape (as it sent it)."""
    return JSONResponse(r.body, status_code=r.status, headers={**turn.headers(), **r.headers})


async def complete(turn: Turn, answer: Answer) -> Response:
    out = await turn.complete()
    if isinstance(out, Refusal):
        return refusal(out, turn)
    choice = out.payload["choices"][0]
    builder = OutputBuilder(answer.namespaces, first_index=len(answer.head))
    builder.feed(whole_message_delta(choice["message"]))
    builder.finish()
    response = answer.response
    finish_response(response, answer.head + builder.items, choice.get("finish_reason"),
                    to_usage(out.payload.get("usage")))
    response.update(turn.extra(out.server_tool_calls))
    await answer.done(response)
    return JSONResponse(response, headers=turn.headers())


def _opening(events: EventStream, response: dict) -> list[bytes]:
    opening = {**response, "status": "in_progress", "output": [], "usage": None}
    opening.pop("completed_at", None)
    return [events.encode("response.created", {"response": opening}),
            events.encode("response.in_progress", {"response": opening})]


def _whole_item(events: EventStream, index: int, item: dict) -> list[bytes]:
    return [events.encode("response.output_item.added", {"output_index": index, "item": item}),
            events.encode("response.output_item.done", {"output_index": index, "item": item})]


def _sse(chunks: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})


def replay(response: dict, session_id: str) -> StreamingResponse:
    """A finished response (a compaction: its items are whole) as its event sequence."""
    async def gen() -> AsyncIterator[bytes]:
        events = EventStream()
        for chunk in _opening(events, response):
            yield chunk
        for i, item in enumerate(response["output"]):
            for chunk in _whole_item(events, i, item):
                yield chunk
        yield events.encode(f"response.{response['status']}", {"response": response})

    return _sse(gen(), {"X-Session-Id": session_id})


async def stream(turn: Turn, answer: Answer) -> Response:
    """Events as the engine's chunks arrive; a refusal before the stream starts is the engine's JSON
    error; a stream the engine breaks off ends with ``response.failed``."""
    es = await turn.stream()
    if isinstance(es, Refusal):
        return refusal(es, turn)
    builder = OutputBuilder(answer.namespaces, first_index=len(answer.head))
    response = answer.response

    async def gen() -> AsyncIterator[bytes]:
        events = EventStream()
        for data in _opening(events, response):
            yield data
        for i, item in enumerate(answer.head):
            for data in _whole_item(events, i, item):
                yield data
        finish, error = None, None
        async for chunk in es.chunks():
            if chunk.get("error") and not chunk.get("choices"):   # the engine reported an error in-stream
                error = error or chunk
                continue
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            out = builder.feed(choice.get("delta") or {})
            if out:  # one write for the events of one engine chunk
                yield b"".join(events.encode(kind, fields) for kind, fields in out)
            finish = choice.get("finish_reason") or finish
        error = es.error or error
        if error is None:
            for kind, fields in builder.finish():
                yield events.encode(kind, fields)
            observe_usage(es.usage)
        closing = finish_response(response, answer.head + builder.items, finish, to_usage(es.usage),
                                  _failure(error) if error else None)
        response.update(turn.extra(es.server_tool_calls))
        yield events.encode(closing, {"response": response})
        await answer.done(response)

    return _sse(gen(), turn.headers())
