"""One chat completion through the engine with server-tool rounds resolved: the engine step every
API shares (/v1/chat/completions, /v1/messages and /v1/responses differ only in how they encode it).

Non-streamed: ``completion`` returns a ``Completion`` or a ``Refusal`` (the engine's error, or an
unreachable engine, before any answer: each API puts it in its own error shape).
Streamed: ``open_stream`` starts the engine's stream (or returns its ``Refusal``), then
``EngineStream.chunks()`` yields the OpenAI ``chat.completion.chunk`` dicts the client should see,
each as soon as the engine sends it. Server tool calls are held until their round ends, executed,
and generation continues; client tool calls are passed on. Afterwards ``usage`` (summed over
rounds), ``server_tool_calls`` and ``error`` (an OpenAI error body when the engine's stream broke
or ended without ``[DONE]``) tell the encoder how to finish. Each engine request is made of its
chat body by ``make`` (``engine_input``: the prompt's token ids added, each round its own).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from agentkv.server.engine.client import (
    EngineClient,
    EngineResponse,
    EngineUnavailable,
    decode_json,
    unavailable_message,
)
from agentkv.server.errors import ENGINE_RETRY_AFTER_S, error_body
from agentkv.server.kv.reuse import continued, take_outcome
from agentkv.server.metrics import observe_usage

from . import server_tools, window
from .server_tools import ToolRunner

PATH = "/v1/chat/completions"
Make = Callable[[dict], Awaitable[dict]]   # the engine request made of a chat body (``engine_input``)
log = logging.getLogger(__name__)


async def as_is(body: dict) -> dict:
    """The engine request of a chat body that goes as it is."""
    return body


@dataclass
class Refusal:
    """The engine refused the request before answering, or could not be reached: the status and
    OpenAI's error body, for each API to answer in its own shape."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


def unreachable(exc: EngineUnavailable) -> Refusal:
    log.warning("the engine could not be reached: %s", exc)
    return Refusal(503, error_body(503, unavailable_message(exc), code="engine_unavailable"),
                   {"Retry-After": str(ENGINE_RETRY_AFTER_S)})


@dataclass
class Completion:
    """A non-streamed answer: the engine's final payload (usage summed over server-tool rounds)
    and the server tool calls run on the way."""

    payload: dict
    server_tool_calls: list[dict] = field(default_factory=list)


def split_calls(calls: list[dict]) -> tuple[list[dict], list[dict]]:
    """(server tool calls, client tool calls)."""
    ours = [c for c in calls if c.get("function", {}).get("name") in server_tools.NAMES]
    return ours, [c for c in calls if c not in ours]


def next_round(body: dict, content: str | None, calls: list[dict], results: list[dict], refit_output: bool) -> dict:
    """The follow-up request: the server calls and their results appended. A forced tool choice or
    output constraint applied to producing the call, so the follow-up is free (`auto`). An output
    limit that was lowered to the room the first prompt left is dropped (the engine then gives the
    follow-up the room its longer prompt leaves)."""
    body = copy.deepcopy(body)
    if refit_output:
        for key in window.OUTPUT_LIMITS:
            body.pop(key, None)
    body["messages"] = body["messages"] + [{"role": "assistant", "content": content, "tool_calls": calls}] + \
        [{"role": "tool", "tool_call_id": r["id"], "content": r["result"]} for r in results]
    if body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"
    body.pop("structured_outputs", None)
    if body.get("kv_transfer_params"):   # the edit was the first round's; this prompt continues that one
        body["kv_transfer_params"] = continued(body["kv_transfer_params"])
    return body


def add_usage(total: dict | None, usage: dict | None) -> dict | None:
    if not usage:
        return total
    if total is None:
        return copy.deepcopy(usage)
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[k] = total.get(k, 0) + usage.get(k, 0)
    return total


async def completion(engine: EngineClient, body: dict, runner: ToolRunner | None,
                     report: dict | None = None, make: Make = as_is) -> Completion | Refusal:
    """Non-streamed, server-tool rounds resolved. A success's usage is counted in the metrics and
    the KV connector's outcome moves into ``report``'s edits."""
    usage, annotations, kv = None, [], None
    try:
        for round_ in range((runner.max_rounds if runner else 0) + 1):
            status, payload = await engine.post_json(PATH, await make(body))
            if status != 200:
                return Refusal(status, payload)
            found = payload.pop("kv_transfer_params", None)   # the KV connector's report, of the edited round
            kv = found if round_ == 0 else kv
            usage = add_usage(usage, payload.get("usage"))
            message = payload["choices"][0]["message"]
            ours, theirs = split_calls(message.get("tool_calls") or [])
            if runner is None or not ours:
                break
            if round_ == runner.max_rounds:  # bound reached: hand back what the client can use
                message["tool_calls"] = theirs or None
                payload["choices"][0]["finish_reason"] = "tool_calls" if theirs else "stop"
                break
            results = await runner.run(ours)
            annotations += results
            if theirs:
                message["tool_calls"] = theirs
                break
            body = next_round(body, message.get("content"), ours, results, runner.refit_output)
    except EngineUnavailable as exc:
        return unreachable(exc)
    if usage is not None:
        payload["usage"] = usage
    observe_usage(usage)
    take_outcome(kv, report)
    return Completion(payload, annotations)


def with_usage(body: dict) -> dict:
    """The engine request of a stream: usage always asked for (encoders need it; the OpenAI encoder
    drops the usage chunk when its client did not ask)."""
    return {**body, "stream": True, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}


async def open_stream(engine: EngineClient, body: dict, runner: ToolRunner | None,
                      make: Make = as_is, on_end: OnEnd | None = None) -> EngineStream | Refusal:
    """Start the engine's stream (usage always asked for: the encoders need it), or its refusal.
    ``on_end`` hears the usage of a stream that ended whole."""
    body = with_usage(body)
    try:
        resp = await engine.post_stream(PATH, await make(body))
        if resp.status_code != 200:
            return Refusal(*await resp.json())
    except EngineUnavailable as exc:
        return unreachable(exc)
    return EngineStream(engine, body, runner, resp, make, on_end)


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, as they arrive, as bytes (lines split
    where SSE splits them: CR, LF, CRLF; a payload is never decoded here)."""
    buf = b""
    async for chunk in chunks:
        buf = buf + chunk if buf else chunk
        if b"\n\n" not in buf:
            continue
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    yield line[5:].strip()


OnEnd = Callable[["dict | None"], Awaitable[None]]


class EngineStream:
    def __init__(self, engine: EngineClient, body: dict, runner: ToolRunner | None, first: EngineResponse,
                 make: Make = as_is, on_end: OnEnd | None = None):
        self.engine, self.body, self.runner, self._resp, self._make = engine, body, runner, first, make
        self._on_end = on_end
        self.usage: dict | None = None
        self.server_tool_calls: list[dict] = []
        self.error: dict | None = None

    async def _round(self, calls: dict[int, dict]) -> AsyncIterator[tuple[dict, bytes]]:
        """One engine stream: (chunk, its JSON as the engine sent it) to pass on (tool-call deltas
        and finishes held back when server tools are on, returned through ``self._held``); sets
        ``self.error`` if it breaks."""
        self._held = []
        done = False
        try:
            async for data in sse_data(self._resp.chunks()):
                if done:  # nothing follows [DONE] but the end of the body; read on to it
                    continue
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = decode_json(data)
                if "error" in chunk and not chunk.get("choices"):
                    yield chunk, data
                    continue
                if not chunk.get("choices"):  # the usage chunk
                    self.usage = add_usage(self.usage, chunk.get("usage"))
                    continue
                delta = chunk["choices"][0].get("delta") or {}
                for tc in delta.get("tool_calls") or []:
                    c = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
                    c["id"] = tc.get("id") or c["id"]
                    fn = tc.get("function") or {}
                    c["function"]["name"] += fn.get("name") or ""
                    c["function"]["arguments"] += fn.get("arguments") or ""
                if self.runner and (delta.get("tool_calls") or chunk["choices"][0].get("finish_reason")):
                    self._held.append(chunk)
                    continue
                yield chunk, data
        except EngineUnavailable as exc:  # the engine went away mid-stream
            self.error = error_body(503, unavailable_message(exc), code="engine_unavailable")
        finally:
            self._resp.close()
        if not done and self.error is None:
            self.error = error_body(503, "the inference engine's stream ended before it was complete",
                                    code="engine_unavailable")

    async def chunks(self) -> AsyncIterator[dict]:
        async for chunk, _ in self.events():
            yield chunk

    async def events(self) -> AsyncIterator[tuple[dict, bytes | None]]:
        """``chunks()`` with each chunk's JSON as the engine sent it, or None where the chunk was
        changed here (a held chunk whose server tool calls were taken out): an encoder that sends
        a chunk unchanged can send those bytes instead of encoding it again."""
        runner = self.runner
        for round_ in range((runner.max_rounds if runner else 0) + 1):
            calls: dict[int, dict] = {}
            async for item in self._round(calls):
                yield item
            if self.error is not None:
                return
            ours, theirs = split_calls([calls[i] for i in sorted(calls)])
            if runner and ours and round_ < runner.max_rounds and not theirs:
                results = await runner.run(ours)
                self.server_tool_calls += results
                self.body = next_round(self.body, None, ours, results, runner.refit_output)
                try:
                    resp = await self.engine.post_stream(PATH, await self._make(self.body))
                    if resp.status_code != 200:  # the follow-up was refused (e.g. the context is full)
                        self.error = (await resp.json())[1]
                        return
                except EngineUnavailable as exc:
                    self.error = error_body(503, unavailable_message(exc), code="engine_unavailable")
                    return
                self._resp = resp
                continue
            if runner and ours:
                self.server_tool_calls += await runner.run(ours) if round_ < runner.max_rounds else []
            keep = {i for i in calls if calls[i] not in ours}
            for chunk in self._held:
                d = chunk["choices"][0].get("delta") or {}
                if d.get("tool_calls"):
                    d["tool_calls"] = [tc for tc in d["tool_calls"] if tc.get("index", 0) in keep]
                    if not d["tool_calls"]:
                        continue
                if chunk["choices"][0].get("finish_reason") == "tool_calls" and not keep:
                    chunk["choices"][0]["finish_reason"] = "stop"
                yield chunk, None
            if self._on_end is not None:   # the whole answer came: its usage is known
                await self._on_end(self.usage)
            return
