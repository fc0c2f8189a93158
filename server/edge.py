"""The edge: what the server checks of a request before any route runs, in the order that costs
an unauthenticated caller nothing.

1. **The key**, from the headers alone (``Authorization: Bearer``, ``x-api-key``), before a byte
   of the body is read: a wrong or missing key is a 401 in the API's own error shape. Every path
   but the health checks (and FastAPI's own docs) needs it. The caller's owner (a digest of the
   key: sessions, salts and caches are namespaced by it) goes into the request's scope. Under
   ``/ui`` (the sessions page, when on) the page's cookie (``ui_auth``) stands for the key too, and
   a browser without either is sent to ``/ui/login`` (its data requests get the 401).
2. **The body's size**: a declared ``Content-Length`` over ``--max-request-mb`` is a 413 at once;
   a chunked body is read up to the limit. The sign-in form (``POST /ui/login``, which anyone may
   send) has a limit of its own, ``LOGIN_MAX_BYTES``, and may not be compressed (a 415).
3. **Compressed bodies** (``Content-Encoding: gzip``, ``deflate``, ``zstd``: Codex may compress
   its requests) are inflated off the event loop, never past the limit (a small body that would
   inflate past it is a 413), and wholly: one gzip member and nothing after it, zlib-wrapped or raw
   deflate (RFC 1950 or 1951: clients send both), zstd frames complete and nothing after them.
   One that does not decode so is a 400, another encoding a 415.
   Headers that say how to read the body (``Content-Type``, ``Content-Encoding``,
   ``Content-Length``) given twice are a 400: the edge and the routes would each read another.
   A body that takes longer than ``body_timeout_s`` to arrive is a 408 (a slow sender does not
   hold a connection open forever).
4. **JSON** is parsed here, off the event loop (msgspec: strict JSON, no ``NaN``, no lone UTF-16
   surrogates; nesting too deep is refused), its work bounded by the size limit; malformed JSON is
   a 400. The routes read the parsed value (``EdgeRoute``), not the bytes again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import zlib
from collections.abc import Sequence
from email.message import Message
from typing import Any

import msgspec
import zstandard
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body_for
from .ui_auth import UICookie

ENCODINGS = (b"gzip", b"deflate", b"zstd")
ZSTD_MAX_WINDOW = 1 << 25
PUBLIC = ("/health", "/health/live", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
UI, UI_LOGIN, UI_DATA = "/ui", "/ui/login", "/ui/api/"
LOGIN_MAX_BYTES = 4096   # the sign-in form: one key (at most 1024 characters, percent-encoded)
OWNER = "agentkv.owner"          # scope["state"] keys the routes read
PARSED = "agentkv.json"
_DECODE = msgspec.json.Decoder()


def owner_of_key(keys: Sequence[str], authorization: str, x_api_key: str) -> str | None:
    """The owner a request's key makes it (``local`` where the server takes no keys); None: no
    valid key. Compared in constant time against every accepted key."""
    if not keys:
        return "local"
    given = authorization[7:] if authorization[:7].lower() == "bearer " else x_api_key
    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
        return None
    return _digest(given)


def owners_of_keys(keys: Sequence[str]) -> frozenset[str]:
    """Every owner ``owner_of_key`` can make of these keys: their digests, or ``local`` for none
    (what a sessions page cookie may name: ``ui_auth.UICookie``)."""
    return frozenset(_digest(k) for k in keys) if keys else frozenset({"local"})


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _is_json(content_type: bytes | None) -> bool:
    """FastAPI's rule: no content type, or ``application/json`` / ``application/*+json``."""
    if not content_type:
        return True
    m = Message()
    m["content-type"] = content_type.decode("latin-1")
    sub = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


def _lone_surrogate(body: bytes) -> bool:
    """Whether valid JSON escapes a UTF-16 surrogate that is not part of a pair (text no UTF-8
    can hold)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False
    try:
        msgspec.json.encode(value)
    except UnicodeEncodeError:
        return True
    return False


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


SINGLE = (b"content-type", b"content-encoding", b"content-length")   # headers a body is read by: at most once


class Edge:
    """ASGI middleware doing the module's four steps (``keys``: the accepted API keys;
    ``body_timeout_s``: how long a body may take to arrive)."""

    def __init__(self, app: ASGIApp, max_bytes: int, keys: Sequence[str] = (), body_timeout_s: float = 60.0,
                 ui: UICookie | None = None):
        self.app, self.max_bytes, self.keys, self.body_timeout_s = app, max_bytes, tuple(keys), body_timeout_s
        self.ui = ui   # the sessions page's cookie, where the page is on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw_headers = scope.get("headers") or []
        headers = dict(raw_headers)
        repeated = sorted({k.decode("latin-1") for k in SINGLE if sum(1 for name, _ in raw_headers if name == k) > 1})
        if repeated:
            return await self._error(scope, send, Refused(
                400, f"the header {repeated[0]} is given more than once: the request is ambiguous", "invalid_header",
                repeated[0]))
        state = scope.setdefault("state", {})
        path = scope.get("path", "")
        if path not in PUBLIC:
            owner = owner_of_key(self.keys, headers.get(b"authorization", b"").decode("latin-1"),
                                 headers.get(b"x-api-key", b"").decode("latin-1"))
            ui = self.ui
            page = ui is not None and (path == UI or path.startswith(UI + "/"))
            if owner is None and ui is not None and page:
                owner = ui.owner(UICookie.from_header(headers.get(b"cookie", b"").decode("latin-1")))
                if owner is None and path != UI_LOGIN and not path.startswith(UI_DATA):
                    return await self._redirect(send, UI_LOGIN)
            if owner is None and not (page and path == UI_LOGIN):
                return await self._error(scope, send, Refused(401, "Incorrect API key provided.", "invalid_api_key"))
            if owner is not None:
                state[OWNER] = owner
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):   # no route here reads a body
            return await self.app(scope, receive, send)
        # the sign-in form is open to anyone: a few KiB of it, sent as it is, never the API's limit
        login = self.ui is not None and path == UI_LOGIN
        try:
            body = await self._body(receive, headers, LOGIN_MAX_BYTES if login else self.max_bytes, plain=login)
            if body is None:                                           # the client went away
                return
            if body and _is_json(headers.get(b"content-type")):
                state[PARSED] = await asyncio.to_thread(self._parse, body)
        except Refused as exc:
            return await self._error(scope, send, exc)
        if b"content-encoding" in headers:
            kept = [(k, v) for k, v in scope.get("headers") or [] if k not in (b"content-encoding", b"content-length")]
            scope = {**scope, "headers": kept + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, self._replay(body, receive), send)

    async def _body(self, receive: Receive, headers: dict, limit: int, plain: bool = False) -> bytes | None:
        """The whole body, decoded, at most ``limit`` bytes; None for a client that went away.
        ``Refused`` past the limit or for a body that does not decode; ``plain``: for any
        ``Content-Encoding`` (a request nobody has authenticated: nothing is inflated for it)."""
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if plain and encoding not in (b"", b"identity"):
            raise Refused(415, "the sign-in form must not be compressed (no Content-Encoding)",
                          "unsupported_encoding")
        if encoding not in (b"", b"identity", *ENCODINGS):
            raise Refused(415, f"Content-Encoding {encoding.decode(errors='replace')!r} is not supported "
                               "(gzip, deflate, zstd)", "unsupported_encoding")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)
        try:
            raw = await asyncio.wait_for(self._read(receive, limit), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise Refused(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                          "request_timeout") from None
        if raw is None:
            return None
        if len(raw) > limit:
            raise self._too_large(limit)
        if encoding not in ENCODINGS:
            return raw
        try:
            body = await asyncio.to_thread(self._inflate, raw, encoding)   # CPU work off the event loop
        except (zlib.error, zstandard.ZstdError, EOFError) as exc:
            raise Refused(400, f"the request body is not valid {encoding.decode()} ({exc})",
                          "invalid_encoding") from None
        if body is None:
            raise self._too_large(limit)
        return body

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None if the client went away; reading stops past ``limit`` (the
        result is then longer than it)."""
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > limit or not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    def _parse(body: bytes) -> Any:
        try:
            return _DECODE.decode(body)
        except RecursionError:
            raise Refused(400, "the request body's JSON is nested too deeply", "invalid_json") from None
        except msgspec.DecodeError as exc:
            if b"\\u" in body and _lone_surrogate(body):   # msgspec calls it "truncated"
                raise Refused(400, "the request holds text that is not valid Unicode (a lone surrogate)",
                              "invalid_json") from None
            raise Refused(400, f"the request body is not valid JSON ({exc})", "invalid_json") from None

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them
        return replay

    def _inflate(self, data: bytes, encoding: bytes) -> bytes | None:
        """The decoded body, or None where it would exceed the limit (never inflated past it).
        ``zlib.error`` / ``ZstdError`` where it is not one whole compressed body."""
        if encoding == b"zstd":
            # a bounded window: a frame may not ask for more than 32 MiB of decoder memory
            reader = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
                io.BytesIO(data), read_across_frames=True)
            chunks, n = [], 0
            while n <= self.max_bytes and (chunk := reader.read(min(1 << 20, self.max_bytes + 1 - n))):
                chunks.append(chunk)
                n += len(chunk)
            if n > self.max_bytes:
                return None
            _whole_zstd(data)   # the reader stops silently at a frame cut short: decoding again (n bytes at most) tells
            return b"".join(chunks)
        if encoding == b"gzip":
            wbits = zlib.MAX_WBITS | 16
        else:   # HTTP's deflate is zlib-wrapped (RFC 1950); many clients send raw deflate (RFC 1951)
            wbits = zlib.MAX_WBITS if len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0 \
                else -zlib.MAX_WBITS
        d = zlib.decompressobj(wbits)
        out = d.decompress(data, self.max_bytes + 1)
        if len(out) > self.max_bytes:
            return None
        if not d.eof:
            raise zlib.error("the compressed body is cut short")
        if d.unused_data:
            raise zlib.error(f"{len(d.unused_data)} bytes follow the compressed body" + (
                " (a second gzip member)" if encoding == b"gzip" and d.unused_data[:2] == b"\x1f\x8b" else ""))
        return out

    @staticmethod
    def _too_large(limit: int) -> Refused:
        return Refused(413, f"request body exceeds {limit} bytes", "request_too_large")

    @staticmethod
    async def _redirect(send: Send, to: str) -> None:
        headers = [(b"location", to.encode()), (b"content-length", b"0"), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 303, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _error(scope: Scope, send: Send, exc: Refused) -> None:
        body = json.dumps(error_body_for(scope.get("path", ""), exc.status, exc.message, exc.param,
                                         code=exc.code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if exc.status == 408:   # the rest of the body may still come: not on this connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _whole_zstd(data: bytes) -> None:
    """``ZstdError`` unless ``data`` is complete zstd frames and nothing else (its output is known
    to be small: the bounded read decoded it)."""
    rest = data
    while rest:
        d = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj()
        d.decompress(rest)
        if not d.eof:
            raise zstandard.ZstdError("the compressed body is cut short (an incomplete zstd frame)")
        rest = d.unused_data


class _ParsedRequest(Request):
    """A request whose JSON the edge parsed already."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            state = self.scope.get("state") or {}
            self._json = state[PARSED] if PARSED in state else await super().json()
        return self._json


class EdgeRoute(APIRoute):
    """Every API route: FastAPI reads the body the edge parsed instead of parsing it again."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_ParsedRequest(request.scope, request.receive))
        return route
