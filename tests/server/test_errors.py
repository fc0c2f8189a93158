"""The last resort (server/errors.py ``LastResort``): an exception anywhere in the front's handling
of a request is an answer in the API's own shape, before a response started (a 500 body) and
after a stream started (the API's error event ends it), never a dropped connection."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from agentkv.server.errors import LastResort, install_error_handlers


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(LastResort)

    @app.post("/v1/{route:path}")
    async def fail(route: str, stream: bool = False):
        if not stream:
            raise TypeError("a bug before the answer")

        async def events():
            yield b"data: {\"choices\": []}\n\n"
            raise TypeError("a bug mid-stream")
        return StreamingResponse(events(), media_type="text/event-stream")

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("route", ["chat/completions", "messages", "responses"])
def test_an_exception_before_the_answer_is_a_500_in_the_apis_shape(client, route):
    r = client.post(f"/v1/{route}")
    assert r.status_code == 500
    body = r.json()
    if route == "messages":
        assert (body["type"] == "error" and body["error"]["type"] == "api_error"
                and "TypeError" in body["error"]["message"])
    else:
        assert body["error"]["code"] == "internal_error" and "TypeError" in body["error"]["message"]


@pytest.mark.parametrize("route", ["chat/completions", "messages", "responses"])
def test_an_exception_mid_stream_ends_it_with_the_apis_error_event(client, route):
    r = client.post(f"/v1/{route}", params={"stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices": []}'
    if route == "chat/completions":
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "internal_error"
    else:
        name, data = events[-1].split("\n")
        assert name == "event: error" and json.loads(data[6:])["type"] == "error"


def test_engine_errors_take_openais_shape_and_keep_their_status():
    """vLLM answers ``{"type": "NotFoundError", "code": 404}``; agentkv relays OpenAI's shape, and
    an Anthropic stream's error event still gets the status the engine meant."""
    from agentkv.server.api.messages.encode import error_event
    from agentkv.server.engine.client import json_of
    from agentkv.server.errors import status_of

    vllm = (b'{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", '
            b'"param": "model", "code": 404}}')
    status, body = json_of(404, vllm)
    assert (status, body) == (404, {"error": {"message": "The model `x` does not exist.", "type": "not_found_error",
                                              "param": "model", "code": "model_not_found"}})
    _, bad = json_of(400, b'{"error": {"message": "too long", "type": "BadRequestError", "param": null, "code": 400}}')
    assert bad["error"]["type"] == "invalid_request_error" and status_of(bad["error"]) == 400
    assert b'"invalid_request_error"' in error_event(bad)                  # not an api_error (500)
    assert json_of(200, b'{"ok": 1}') == (200, {"ok": 1})
