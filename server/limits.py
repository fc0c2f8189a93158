"""Request bodies as ASGI middleware: the size limit, and compressed bodies.

A declared ``Content-Length`` over the limit is refused at once (413). A body sent without one
(chunked) is read here, up to the limit, and handed to the app whole; the app would buffer it anyway
to parse the JSON, and a limit hit inside the app's own read would surface as its parse error (400).
A body sent with ``Content-Encoding: gzip``, ``deflate`` or ``zstd`` (Codex may compress its
requests) is read whole and decompressed here, the limit applying to what it decompresses to (a
small body that would inflate past it is a 413, never inflated further); a body that does not
decode is a 400, another encoding a 415.
"""

from __future__ import annotations

import asyncio
import io
import json
import zlib

import zstandard

from .errors import error_body_for

ENCODINGS = (b"gzip", b"deflate", b"zstd")
ZSTD_MAX_WINDOW = 1 << 25


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            return await self._decoded(scope, receive, send, encoding)
        declared = headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._reject(scope, send)
            return await self.app(scope, receive, send)  # the server delivers no more than declared
        body = await self._read(receive)
        if body is None:                  # the client went away
            return
        if len(body) > self.max_bytes:
            return await self._reject(scope, send)
        await self.app(scope, self._replay(body, receive), send)

    async def _read(self, receive) -> bytes | None:
        """The whole body, or None if the client went away; reading stops past the limit (the result
        is then longer than it)."""
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_bytes or not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    def _replay(body: bytes, receive):
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them
        return replay

    async def _decoded(self, scope, receive, send, encoding: bytes):
        if encoding not in ENCODINGS:
            return await self._error(scope, send, 415, f"Content-Encoding {encoding.decode(errors='replace')!r} is not "
                                                       "supported (gzip, deflate, zstd)", "unsupported_encoding")
        raw = await self._read(receive)
        if raw is None:
            return
        if len(raw) > self.max_bytes:
            return await self._reject(scope, send)
        try:
            body = await asyncio.to_thread(self._inflate, raw, encoding)  # CPU work off the event loop
        except (zlib.error, zstandard.ZstdError, EOFError) as exc:
            return await self._error(scope, send, 400, f"the request body is not valid {encoding.decode()} ({exc})",
                                     "invalid_encoding")
        if body is None:
            return await self._reject(scope, send)
        kept = [(k, v) for k, v in scope.get("headers") or [] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": kept + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, self._replay(body, receive), send)

    def _inflate(self, data: bytes, encoding: bytes) -> bytes | None:
        """The decoded body, or None where it would exceed the limit (never inflated past it)."""
        if encoding == b"zstd":
            # a bounded window: a frame may not ask for more than 32 MiB of decoder memory
            reader = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(io.BytesIO(data))
            chunks, n = [], 0
            while n <= self.max_bytes and (chunk := reader.read(min(1 << 20, self.max_bytes + 1 - n))):
                chunks.append(chunk)
                n += len(chunk)
            out = b"".join(chunks)
        else:
            d = zlib.decompressobj(zlib.MAX_WBITS | 32 if encoding == b"gzip" else zlib.MAX_WBITS)
            out = d.decompress(data, self.max_bytes + 1)
            if not d.eof and len(out) <= self.max_bytes:
                raise zlib.error("the compressed body is cut short")
        return None if len(out) > self.max_bytes else out

    async def _reject(self, scope, send):
        await self._error(scope, send, 413, f"request body exceeds {self.max_bytes} bytes", "request_too_large")

    async def _error(self, scope, send, status: int, message: str, code: str):
        body = json.dumps(error_body_for(scope.get("path", ""), status, message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
