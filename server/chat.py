"""One chat completion through the engine: server tool rounds, streamed or not, with the
context-management report attached to the response (or to the stream's final chunk)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..compaction.session_log import SessionLog
from . import server_tools
from .metrics import observe_usage
from .proxy import EngineClient, json_of, relay_stream, stream_error, unavailable

PATH = "/v1/chat/completions"


class ToolRunner:
    """Executes server tool calls against one session and logs the exchange (append-only)."""

    def __init__(self, log: SessionLog, session: str, max_rounds: int):
        self.log, self.session, self.max_rounds = log, session, max_rounds

    async def run(self, calls: list[dict]) -> list[dict]:
        def work() -> list[dict]:
            out = [{"id": c.get("id"), "name": c["function"]["name"], "arguments": c["function"].get("arguments", ""),
                    "result": server_tools.execute(self.log, self.session, c["function"]["name"],
                                                   c["function"].get("arguments", ""))} for c in calls]
            self.log.append(self.session, [{"role": "assistant", "content": None, "tool_calls": calls}] +
                            [{"role": "tool", "tool_call_id": r["id"], "content": r["result"]} for r in out])
            return out
        return await asyncio.to_thread(work)


def _split(calls: list[dict]) -> tuple[list[dict], list[dict]]:
    ours = [c for c in calls if c.get("function", {}).get("name") in server_tools.NAMES]
    return ours, [c for c in calls if c not in ours]


def _next_round(body: dict, content: str | None, calls: list[dict], results: list[dict]) -> dict:
    """The follow-up request: the server calls and their results appended. A forced tool choice or
    output constraint applied to producing the call, so the follow-up is free (`auto`)."""
    body = copy.deepcopy(body)
    body["messages"] = body["messages"] + [{"role": "assistant", "content": content, "tool_calls": calls}] + \
        [{"role": "tool", "tool_call_id": r["id"], "content": r["result"]} for r in results]
    if body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"
    body.pop("structured_outputs", None)
    return body


def _add_usage(total: dict | None, usage: dict | None) -> dict | None:
    if not usage:
        return total
    if total is None:
        return copy.deepcopy(usage)
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[k] = total.get(k, 0) + usage.get(k, 0)
    return total


def _extra(report: dict | None, annotations: list[dict]) -> dict:
    out: dict[str, Any] = {}
    if report is not None:
        out["context_management"] = report
    if annotations:
        out["server_tool_calls"] = annotations
    return out


async def complete(engine: EngineClient, body: dict, report: dict | None, runner: ToolRunner | None) -> Response:
    usage, annotations = None, []
    try:
        for round_ in range((runner.max_rounds if runner else 0) + 1):
            status, payload = await engine.post_json(PATH, body)
            if status != 200:
                return JSONResponse(payload, status_code=status)
            usage = _add_usage(usage, payload.get("usage"))
            message = payload["choices"][0]["message"]
            ours, theirs = _split(message.get("tool_calls") or [])
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
            body = _next_round(body, message.get("content"), ours, results)
    except httpx.TransportError as exc:
        return unavailable(exc)
    if usage is not None:
        payload["usage"] = usage
    observe_usage(usage)
    payload.update(_extra(report, annotations))
    return JSONResponse(payload)


async def _events(resp: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream."""
    buf = b""
    async for chunk in resp.aiter_raw():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def stream(engine: EngineClient, body: dict, report: dict | None, runner: ToolRunner | None) -> Response:
    """Content deltas pass through as they come. With server tools, tool-call deltas are held until
    the round ends: server calls are executed and generation continues; client calls are sent on.
    The last chunk carries the context-management report."""
    try:
        first = await engine.post_stream(PATH, body)
    except httpx.TransportError as exc:
        return unavailable(exc)
    if first.status_code != 200:
        return await relay_stream(first)

    async def gen() -> AsyncIterator[bytes]:
        nonlocal body
        resp, usage, annotations, last = first, None, [], None
        for round_ in range((runner.max_rounds if runner else 0) + 1):
            held, calls = [], {}
            try:
                async for data in _events(resp):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk and not chunk.get("choices"):
                        yield _sse(chunk)
                        continue
                    if not chunk.get("choices"):  # the usage chunk
                        usage = _add_usage(usage, chunk.get("usage"))
                        continue
                    delta = chunk["choices"][0].get("delta") or {}
                    for tc in delta.get("tool_calls") or []:
                        c = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                 "function": {"name": "", "arguments": ""}})
                        c["id"] = tc.get("id") or c["id"]
                        fn = tc.get("function") or {}
                        c["function"]["name"] += fn.get("name") or ""
                        c["function"]["arguments"] += fn.get("arguments") or ""
                    if runner and (delta.get("tool_calls") or chunk["choices"][0].get("finish_reason")):
                        held.append(chunk)
                        continue
                    if last is not None:
                        yield _sse(last)
                    last = chunk
            except httpx.TransportError as exc:  # the engine went away mid-stream
                if last is not None:
                    yield _sse(last)
                yield stream_error(exc)
                return
            finally:
                await resp.aclose()
            ours, theirs = _split([calls[i] for i in sorted(calls)])
            if runner and ours and round_ < runner.max_rounds and not theirs:
                results = await runner.run(ours)
                annotations += results
                body = _next_round(body, None, ours, results)
                try:
                    resp = await engine.post_stream(PATH, body)
                except httpx.TransportError as exc:
                    yield stream_error(exc)
                    return
                if resp.status_code != 200:  # the follow-up was refused (e.g. the context is full)
                    await resp.aread()
                    await resp.aclose()
                    yield _sse(json_of(resp)[1])
                    break
                continue
            if runner and ours:
                annotations += await runner.run(ours) if round_ < runner.max_rounds else []
            keep = {i for i in calls if calls[i] not in ours}
            for chunk in held:
                d = chunk["choices"][0].get("delta") or {}
                if d.get("tool_calls"):
                    d["tool_calls"] = [tc for tc in d["tool_calls"] if tc.get("index", 0) in keep]
                    if not d["tool_calls"]:
                        continue
                if chunk["choices"][0].get("finish_reason") == "tool_calls" and not keep:
                    chunk["choices"][0]["finish_reason"] = "stop"
                if last is not None:
                    yield _sse(last)
                last = chunk
            break
        observe_usage(usage)
        if usage is not None:
            if last is not None:
                yield _sse(last)
            last = {"id": (last or {}).get("id"), "object": "chat.completion.chunk", "choices": [],
                    "model": (last or {}).get("model"), "usage": usage}
        if last is not None:
            last.update(_extra(report, annotations))
            yield _sse(last)
        yield _sse("[DONE]")

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
