"""HTTP client to the vLLM child (on its Unix socket): JSON calls, streamed calls, and errors mapped to
OpenAI bodies."""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from agentkv.server import timing
from agentkv.server.errors import ENGINE_RETRY_AFTER_S, error_body, error_response

from .progress import Awaiting

log = logging.getLogger(__name__)
encode_json = msgspec.json.encode  # compact, UTF-8 (vLLM's own events are too), a few times faster than json


def decode_json(data: bytes) -> Any:
    """JSON from the engine: msgspec (the same values as ``json.loads``, a few times faster); the
    literals only Python's json reads (NaN, Infinity) by json."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


def json_of(status: int, data: bytes) -> tuple[int, Any]:
    try:
        body = decode_json(data)
    except ValueError:
        return status, error_body(status, data.decode(errors="replace") or "engine returned no body")
    return status, openai_error(status, body) if status >= 400 else body


def openai_error(status: int, body: Any) -> Any:
    """An engine's error in OpenAI's shape: vLLM names its exception's class as ``type`` and the
    status as an integer ``code`` (``{"type": "NotFoundError", "code": 404}``); OpenAI's types are
    ``invalid_request_error`` and the like, its codes strings (an unknown model: ``model_not_found``)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return body
    param = err.get("param") if isinstance(err.get("param"), str) else None
    code = err.get("code") if isinstance(err.get("code"), str) else None
    if code is None and status == 404 and param == "model":
        code = "model_not_found"
    return error_body(status, str(err.get("message") or f"the engine answered {status}"), param, code)


JSON = {"Content-Type": "application/json"}
ENGINE_URL = "http://engine"  # the engine's URL on its Unix socket (the host name is only a placeholder)
# what aiohttp raises when the engine cannot be reached or its connection breaks
_TRANSPORT = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class EngineUnavailable(Exception):
    """The engine could not be reached, or its connection broke; ``kind`` names aiohttp's error."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = type(cause).__name__


class EngineResponse:
    """A streamed engine response: ``status_code``, the body in ``chunks()`` as it arrives (or
    ``read()`` whole); ``close()`` releases its connection. Its place among the requests awaiting
    the engine (``Awaiting``, the stall watchdog's) ends with the first byte of its body, or its
    end: never later, so a client that stops reading cannot make the engine look busy. Transport
    errors come out as ``EngineUnavailable``."""

    def __init__(self, resp: aiohttp.ClientResponse, awaiting: Awaiting | None = None):
        self._resp, self.status_code = resp, resp.status
        # ends at the first byte, at ``close()``, or with the object where nobody closed it (once)
        self._answered = weakref.finalize(self, awaiting.leave) if awaiting else None

    def _first_byte(self) -> None:
        if self._answered is not None:
            self._answered()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _TRANSPORT as exc:
            raise EngineUnavailable(exc) from exc
        finally:
            self._first_byte()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                self._first_byte()
                yield chunk
        except _TRANSPORT as exc:
            raise EngineUnavailable(exc) from exc
        finally:
            self._first_byte()

    async def json(self) -> tuple[int, Any]:
        """(status, the body as JSON or an error body) of a refusal; the connection is handed back."""
        try:
            return json_of(self.status_code, await self.read())
        finally:
            self.close()

    def close(self) -> None:
        self._resp.release()
        self._first_byte()

    def fail(self, exc: BaseException) -> None:
        """The next read raises ``exc`` (as ``EngineUnavailable``)."""
        if not self._resp.content.is_eof():
            self._resp.content.set_exception(exc)


class EngineClient:
    """Talks to one engine on its Unix socket with its secret: one aiohttp session for the front
    (its C HTTP parser reads a streamed chunk for a fraction of a pure-Python client's cost)."""

    def __init__(self, socket_path: str, secret: str):
        self.socket_path = socket_path
        self.awaiting = Awaiting()   # work requests (POSTs) of this launch with no answer yet: the stall watchdog's
        self._open: weakref.WeakSet[EngineResponse] = weakref.WeakSet()   # responses not yet closed
        # a new connection per request (a Unix socket connects in microseconds): a kept-alive one can
        # be closed by vLLM's keep-alive timeout just as a request is sent on it (seen under load as
        # ClientOSError, and a POST is not retried); no bound on connections (one per stream)
        self._http = aiohttp.ClientSession(
            base_url=ENGINE_URL, headers={"Authorization": f"Bearer {secret}"},
            connector=aiohttp.UnixConnector(path=socket_path, limit=0, force_close=True),
            # a generous connect timeout: a dead engine refuses at once; 5 s fired on a live one when 8
            # agent sessions kept 2 cores busy (the front's loop served the timer late: 4 spurious 503s)
            timeout=aiohttp.ClientTimeout(total=None, connect=30.0), auto_decompress=False)

    async def aclose(self) -> None:
        self.fail_open("the engine's connection was closed")
        await self._http.close()

    def fail_open(self, why: str) -> None:
        """Every response still open raises at its next read (``EngineUnavailable``): a stream
        whose engine was killed ends with an error at once (a connection this side closes does
        not always tell its reader)."""
        for resp in list(self._open):
            resp.fail(aiohttp.ClientConnectionError(why))

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> EngineResponse:
        data = None if body is None else encode_json(body)
        if self._http.closed:   # a request of a route that started before the engine was relaunched
            raise EngineUnavailable(aiohttp.ClientConnectionError("the engine was relaunched since this request "
                                                                  "began"))
        work = self.awaiting if method == "POST" else None
        if work is not None:
            work.enter()
        timing.mark("engine_sent")
        try:
            resp = await self._http.request(method, path, data=data, headers=None if body is None else JSON)
        except BaseException as exc:
            if work is not None:
                work.leave()
            if isinstance(exc, _TRANSPORT):
                raise EngineUnavailable(exc) from exc
            if isinstance(exc, RuntimeError) and self._http.closed:   # closed while it was being sent
                raise EngineUnavailable(aiohttp.ClientConnectionError("the engine was relaunched")) from exc
            raise
        timing.mark("engine_answered")
        out = EngineResponse(resp, work)
        self._open.add(out)
        return out

    async def _whole(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        resp = await self._request(method, path, body)
        try:
            return resp.status_code, await resp.read()
        finally:
            resp.close()

    async def get_text(self, path: str) -> tuple[int, str]:
        status, data = await self._whole("GET", path)
        return status, data.decode(errors="replace")

    async def get_json(self, path: str) -> tuple[int, Any]:
        return json_of(*await self._whole("GET", path))

    async def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return json_of(*await self._whole("POST", path, body))

    async def post_stream(self, path: str, body: dict[str, Any]) -> EngineResponse:
        """Open a streamed POST; the caller must ``close()`` the response."""
        return await self._request("POST", path, body)


def unavailable_message(exc: EngineUnavailable) -> str:
    return f"the inference engine is unavailable: {exc.kind}"


def unavailable(exc: EngineUnavailable) -> JSONResponse:
    log.warning("the engine could not be reached: %s", exc)
    return error_response(503, unavailable_message(exc), code="engine_unavailable",
                          headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})


def stream_error(exc: EngineUnavailable) -> bytes:
    """The end of a stream whose engine went away: an OpenAI-style error event, then [DONE]
    (the official clients raise an APIError on it instead of hanging or seeing a cut)."""
    body = error_body(503, unavailable_message(exc), code="engine_unavailable")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def relay_stream(resp: EngineResponse) -> Response:
    """Relay a streamed engine response: SSE bytes as they come, or the engine's error as JSON. A
    stream that breaks, or ends without ``[DONE]``, ends with an error event instead of looking complete."""
    if resp.status_code != 200:
        status, payload = await resp.json()
        return JSONResponse(payload, status_code=status)

    async def body() -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in resp.chunks():
                tail = (tail + chunk)[-64:]
                yield chunk
        except EngineUnavailable as exc:
            yield stream_error(exc)
            return
        if b"data: [DONE]" not in tail:
            yield stream_error(EngineUnavailable(EngineStreamCut("the stream ended before [DONE]")))

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"}, background=BackgroundTask(resp.close))


class EngineStreamCut(Exception):
    """The engine's stream ended before ``[DONE]``."""
