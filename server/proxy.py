"""HTTP client to the vLLM child: JSON calls, streamed calls, and errors mapped to OpenAI bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .errors import error_body, error_response


encode_json = msgspec.json.encode  # compact, UTF-8 (vLLM's own events are too), a few times faster than json


def decode_json(data: bytes) -> Any:
    """JSON from the engine: msgspec (the same values as ``json.loads``, a few times faster); the
    literals only Python's json reads (NaN, Infinity) by json."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


def json_of(r: httpx.Response) -> tuple[int, Any]:
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, error_body(r.status_code, r.text or "engine returned no body")


JSON = {"Content-Type": "application/json"}


class EngineClient:
    """Talks to one engine at ``base_url`` with its secret. One connection pool for the front."""

    def __init__(self, base_url: str, secret: str):
        self.base_url = base_url
        self._http = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0),
            # idle connections dropped before vLLM's own keep-alive timeout (5 s) closes them: a
            # request sent on a connection the engine is closing fails with a ReadError
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64, keepalive_expiry=2.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get_text(self, path: str) -> tuple[int, str]:
        r = await self._http.get(path)
        return r.status_code, r.text

    async def get_json(self, path: str) -> tuple[int, Any]:
        return json_of(await self._http.get(path))

    async def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return json_of(await self._http.post(path, content=encode_json(body), headers=JSON))

    async def post_stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Open a streamed POST; the caller must ``aclose()`` the response."""
        request = self._http.build_request("POST", path, content=encode_json(body), headers=JSON)
        return await self._http.send(request, stream=True)


def unavailable_message(exc: Exception) -> str:
    return f"the inference engine is unavailable: {exc.__class__.__name__}"


def unavailable(exc: Exception) -> JSONResponse:
    return error_response(503, unavailable_message(exc), code="engine_unavailable")


def stream_error(exc: Exception) -> bytes:
    """The end of a stream whose engine went away: an OpenAI-style error event, then [DONE]
    (the official clients raise an APIError on it instead of hanging or seeing a cut)."""
    body = error_body(503, unavailable_message(exc), code="engine_unavailable")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def relay_stream(resp: httpx.Response) -> Response:
    """Relay a streamed engine response: SSE bytes as they come, or the engine's error as JSON. A
    stream that breaks, or ends without ``[DONE]``, ends with an error event instead of looking complete."""
    if resp.status_code != 200:
        await resp.aread()
        await resp.aclose()
        status, payload = json_of(resp)
        return JSONResponse(payload, status_code=status)

    async def body() -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-64:]
                yield chunk
        except httpx.TransportError as exc:
            yield stream_error(exc)
            return
        if b"data: [DONE]" not in tail:
            yield stream_error(EngineStreamCut())

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"}, background=BackgroundTask(resp.aclose))


class EngineStreamCut(Exception):
    """The engine's stream ended before ``[DONE]``."""
