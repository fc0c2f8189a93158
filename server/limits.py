"""Request-size limit as ASGI middleware: a body over the limit gets 413 before it is parsed.

A declared ``Content-Length`` over the limit is refused at once. A body sent without one (chunked)
is read here, up to the limit, and handed to the app whole; the app would buffer it anyway to
parse the JSON, and a limit hit inside the app's own read would surface as its parse error (400).
"""

from __future__ import annotations

import json

from .errors import error_body_for


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._reject(scope, send)
            return await self.app(scope, receive, send)  # the server delivers no more than declared
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_bytes:
                return await self._reject(scope, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them

        await self.app(scope, replay, send)

    async def _reject(self, scope, send):
        body = json.dumps(error_body_for(scope.get("path", ""), 413, f"request body exceeds {self.max_bytes} bytes",
                                         code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
