"""Error bodies: OpenAI's `{"error": {"message", "type", "param", "code"}}`, and Anthropic's
`{"type": "error", "error": {"type", "message"}}` on /v1/messages."""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

import jinja2
import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .render.engine_chat import ConversationRefused

log = logging.getLogger(__name__)
SESSION_LOG_ERRORS = (sqlite3.OperationalError, psycopg.OperationalError)
SESSION_LOG_OPEN_ERRORS = (sqlite3.DatabaseError, psycopg.Error)  # a --session-db that cannot be opened
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}




def status_of(error: dict, default: int = 500) -> int:
    """The HTTP status an OpenAI error body (its inner ``error``) stands for: an integer ``code``
    (vLLM's in-stream errors), else its ``type`` (``_TYPES``), else ``default``."""
    code = error.get("code")
    if isinstance(code, int):
        return code
    if code == "engine_unavailable":
        return 503
    return next((st for st, kind in _TYPES.items() if kind == error.get("type") and st != 413), default)


# how long a client should wait before trying again when the engine is down or being relaunched
ENGINE_RETRY_AFTER_S = 10


class APIError(Exception):
    """Raise anywhere in a route to answer with an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code or error_code
        self.error_code = error_code   # Anthropic's ``error.details.error_code`` (on /v1/messages)
        self.headers = headers


class PromptTooLong(APIError):
    """The prompt does not fit the served window: a 400 in each API's own words (Anthropic's
    ``prompt is too long: N tokens > M maximum``, which Claude Code understands and does not retry;
    OpenAI's ``context_length_exceeded``), naming both numbers and the flag that sets the window."""

    def __init__(self, tokens: int, window: int, what: str = "the prompt", param: str = "messages"):
        hint = (f"{what}: {tokens} tokens; the served window: {window}, set by `agentkv serve --max-model-len` "
                "(at most the model's own)")
        super().__init__(400, f"This model's maximum context length is {window} tokens. However, your request "
                              f"has {tokens} input tokens: {hint}.", param=param, code="context_length_exceeded")
        self.anthropic_message = f"prompt is too long: {tokens} tokens > {window} maximum ({hint})"
        self.tokens, self.window = tokens, window


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                             else "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str, error_code: str | None = None) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict = {"type": kind, "message": message}
    if error_code:
        error["details"] = {"error_code": error_code}
    return {"type": "error", "error": error}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def error_body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                   error_code: str | None = None) -> dict:
    """OpenAI's error body, or Anthropic's (``{"type": "error", "error": {...}}``) on /v1/messages."""
    if path.startswith("/v1/messages"):  # no `param` there: the message names the field
        text = message if not param or param in message else f"{param}: {message}"
        return anthropic_error_body(status, text, error_code)
    return error_body(status, message, param, code)


def _respond(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
             headers: dict | None = None, error_code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body_for(request.url.path, status, message, param, code, error_code),
                        status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if isinstance(exc, PromptTooLong) and request.url.path.startswith("/v1/messages"):
            return JSONResponse(anthropic_error_body(exc.status, exc.anthropic_message), status_code=exc.status)
        return _respond(request, exc.status, exc.message, exc.param, exc.code, headers=exc.headers,
                        error_code=exc.error_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = tuple(first.get("loc", ()))
        if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # name the tag field
            loc += (str((first.get("ctx") or {}).get("discriminator", "type")).strip("'"),)
        param = _loc_to_param(loc)
        where = f"'{param}': " if param else ""
        return _respond(request, 400, f"{where}{first.get('msg', 'invalid request')}", param)

    @app.exception_handler(jinja2.TemplateError)
    async def _template(request: Request, exc: jinja2.TemplateError) -> JSONResponse:
        """The model's chat template refused the conversation (``raise_exception`` in many HF
        templates: roles that do not alternate, say): the request's conversation is at fault."""
        param = "input" if request.url.path.startswith("/v1/responses") else "messages"
        return _respond(request, 400, f"the model's chat template cannot render this conversation: {exc}", param)

    @app.exception_handler(ConversationRefused)
    async def _refused(request: Request, exc: ConversationRefused) -> JSONResponse:
        """vLLM's request model or chat template refused the conversation, as the engine would."""
        param = "input" if request.url.path.startswith("/v1/responses") else "messages"
        return _respond(request, 400, str(exc), param)

    async def _log_down(request: Request, exc: Exception) -> JSONResponse:
        return _respond(request, 503, f"the session log is unavailable: {exc.__class__.__name__}",
                        code="session_log_unavailable")

    for db_error in SESSION_LOG_ERRORS:  # the database went away (PostgreSQL restart, disk gone)
        app.add_exception_handler(db_error, _log_down)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _respond(request, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def stream_error_event(path: str, status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream in error, in the API's own shape: Anthropic's ``event: error``
    on /v1/messages, the Responses API's ``error`` event on /v1/responses, else OpenAI's error body
    as data and ``[DONE]``."""
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + json.dumps(anthropic_error_body(status, message)).encode() + b"\n\n"
    if path.startswith("/v1/responses"):
        event = {"type": "error", "code": code or "server_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\ndata: [DONE]\n\n"


class LastResort:
    """ASGI middleware: an exception anywhere in the handling of a request is an answer in the API's
    shape, never a dropped connection: a 500 error body, or, where a stream has started, the API's
    error event ending it (``stream_error_event``). The exception is logged with its traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, events = False, False

        async def send_(message: Message) -> None:
            nonlocal started, events
            if message["type"] == "http.response.start":
                started = True
                events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers") or [])
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as exc:  # noqa: BLE001 - the point of this middleware
            path = scope.get("path", "")
            log.exception("%s %s failed", scope.get("method"), path)
            message = f"the server failed to handle this request ({exc.__class__.__name__})"
            if not started:
                body = json.dumps(error_body_for(path, 500, message, code="internal_error")).encode()
                await send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            else:
                tail = stream_error_event(path, 500, message, "internal_error") if events else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})

