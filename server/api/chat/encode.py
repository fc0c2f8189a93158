"""OpenAI Chat Completions encoding of the shared turn (``pipeline.turn``): the JSON response, or
server-sent events passed on as the engine sends them, with agentkv's report attached to the
response (or to the stream's final chunk)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentkv.server.engine.client import encode_json
from agentkv.server.metrics import observe_usage
from agentkv.server.pipeline.engine_call import Refusal
from agentkv.server.pipeline.turn import Turn


def refusal(r: Refusal, turn: Turn) -> JSONResponse:
    """The engine's refusal as it sent it (OpenAI's error shape already)."""
    return JSONResponse(r.body, status_code=r.status, headers={**turn.headers(), **r.headers})


async def complete(turn: Turn) -> Response:
    out = await turn.complete()
    if isinstance(out, Refusal):
        return refusal(out, turn)
    out.payload.update(turn.extra(out.server_tool_calls))
    return JSONResponse(out.payload, headers=turn.headers())


def split_finish(chunk: dict) -> tuple[dict | None, dict]:
    """A finishing chunk as (what it delivers, to send now; the bare finish, to hold). vLLM puts
    the last token in the finishing chunk: holding it whole would hold that token too."""
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    if not any(v for k, v in delta.items() if k != "role") and not choice.get("logprobs"):
        return None, chunk
    now = {**chunk, "choices": [{k: v for k, v in choice.items() if k != "stop_reason"} | {"finish_reason": None}]}
    finish = {k: v for k, v in choice.items() if k in ("index", "finish_reason", "stop_reason")}
    return now, {**chunk, "choices": [{**finish, "delta": {}, "logprobs": None}]}


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else encode_json(obj)) + b"\n\n"


async def stream(turn: Turn) -> Response:
    """Chunks pass through as the engine sends them; only the bare finish (``finish_reason``, the
    last token split off and sent at once) waits for the end of the stream, so the report can ride
    on it (or on the usage chunk, when the client asked for usage).
    A stream the engine broke off ends with an OpenAI error event, then ``[DONE]``."""
    client_usage = bool((turn.body.get("stream_options") or {}).get("include_usage"))
    es = await turn.stream()
    if isinstance(es, Refusal):
        return refusal(es, turn)

    async def gen() -> AsyncIterator[bytes]:
        finishing: list[dict] = []
        async for chunk, data in es.events():
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                now, finish = split_finish(chunk)
                if now is not None:
                    yield _sse(now)
                finishing.append(finish)
            else:  # passed on as the engine sent it
                yield b"data: " + data + b"\n\n" if data is not None else _sse(chunk)
        if es.error is not None:
            yield _sse(es.error)
            yield _sse("[DONE]")
            return
        observe_usage(es.usage)
        for chunk in finishing[:-1]:
            yield _sse(chunk)
        last = finishing[-1] if finishing else None
        if client_usage and es.usage is not None:
            if last is not None:
                yield _sse(last)
            last = {"id": (last or {}).get("id"), "object": "chat.completion.chunk",
                    "created": (last or {}).get("created"), "model": (last or {}).get("model"),
                    "choices": [], "usage": es.usage}
        if last is not None:
            last.update(turn.extra(es.server_tool_calls))
            yield _sse(last)
        yield _sse("[DONE]")

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **turn.headers()})
