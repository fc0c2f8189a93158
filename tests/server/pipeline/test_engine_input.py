"""Token ids to vLLM (``--engine-input tokens``, the default): every API's answer through the
token-in path equals the messages path's (the request's ``engine_input: "messages"``) token for
token, streamed and not, greedy text and tool calls, on the test model and the embedded SmolLM2;
the ids are vLLM's own render of the request (the engine's ``/tokenize``), across keys and for
what vLLM normalizes; requests vLLM renders itself go as messages and are counted by why.
``test_render_differential`` checks the render over real chat templates in process."""

from __future__ import annotations

import asyncio
import uuid

import anthropic
import pytest

from agentkv.benchmarks.front import engine_of
from agentkv.server.engine.client import EngineClient

from conftest import API_KEY, REAL, TINY

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "list_cities"}}]   # no description: vLLM renders null
QUESTION = "What is the capital of France? Then check its weather."
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def metric(server, input_: str, reason: str) -> float:
    text = server.http().get("/metrics").text
    line = f'agentkv_engine_input_requests_total{{input="{input_}",reason="{reason}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def chat(server, model: str, engine_input: str, stream: bool, tools: bool) -> tuple:
    c = server.client()
    kw = dict(model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
              max_tokens=24, temperature=0, extra_headers={"X-Session-Id": f"ei-{uuid.uuid4().hex[:12]}"},
              extra_body={"engine_input": engine_input})
    if tools:
        kw.update(tools=CHAT_TOOLS, tool_choice="required")
    if not stream:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        return (m.content or "", [(t.function.name, t.function.arguments) for t in m.tool_calls or []],
                r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
    text, calls, finish, usage = "", {}, None, None
    for ch in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for t in choice.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
    return text, [calls[i] for i in sorted(calls)], finish, usage.prompt_tokens, usage.completion_tokens


def messages(server, model: str, engine_input: str, stream: bool, tools: bool) -> tuple:
    c = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=600)
    kw = dict(model=model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
              extra_headers={"X-Session-Id": f"ei-{uuid.uuid4().hex[:12]}"},
              extra_body={"engine_input": engine_input, "temperature": 0})
    if tools:
        kw.update(tools=[{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}],
                  tool_choice={"type": "any"})
    if stream:
        with c.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = c.messages.create(**kw)
    return ([(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
             for b in r.content],
            r.stop_reason, r.usage.output_tokens,   # Anthropic's input_tokens leave out what the cache read
            r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) + (r.usage.cache_creation_input_tokens or 0))


def responses(server, model: str, engine_input: str, stream: bool, tools: bool) -> tuple:
    c = server.client()
    kw = dict(model=model, instructions=SYSTEM, input=QUESTION, max_output_tokens=24, temperature=0, store=False,
              extra_headers={"X-Session-Id": f"ei-{uuid.uuid4().hex[:12]}"}, extra_body={"engine_input": engine_input})
    if tools:
        kw.update(tools=[{"type": "function", "name": "get_weather", "description": "The weather in a city",
                          "parameters": WEATHER}], tool_choice="required")
    if stream:
        r = next(e.response for e in c.responses.create(**kw, stream=True) if e.type in ("response.completed",
                                                                                          "response.incomplete"))
    else:
        r = c.responses.create(**kw)
    items = [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
              [p.text for p in getattr(i, "content", None) or [] if p.type == "output_text"]) for i in r.output]
    return items, r.status, r.usage.input_tokens, r.usage.output_tokens


APIS = {"chat": chat, "messages": messages, "responses": responses}


@pytest.fixture(params=[TINY, REAL], scope="module")
def served(request):
    return request.getfixturevalue("server" if request.param == TINY else "real_server"), request.param


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool_call"])
@pytest.mark.parametrize("api", list(APIS))
def test_token_ids_answer_as_messages_do(served, api, tools):
    """Greedy, each API, streamed and not: the token-in answer is the messages path's, token for
    token (text, tool calls, finish, usage); both paths counted in /metrics."""
    server, model = served
    before = metric(server, "tokens", ""), metric(server, "messages", "request")
    answers = []
    for stream in (False, True):
        tokens = APIS[api](server, model, "tokens", stream, tools)
        msgs = APIS[api](server, model, "messages", stream, tools)
        assert tokens == msgs, (api, stream)
        answers.append(tokens)
    assert metric(server, "tokens", "") >= before[0] + 2 and metric(server, "messages", "request") >= before[1] + 2
    if tools:   # a forced call (vLLM's structured outputs, applied on both paths); the random model's
        assert "get_weather" in str(answers) or "list_cities" in str(answers)   # arguments may not parse in time


def test_fields_vllm_renders_with_go_as_tokens_and_echo_as_messages(server):
    """Fields that change vLLM's render (``chat_template_kwargs``, ``add_generation_prompt``,
    ``continue_final_message``) are rendered by vLLM's own code in the front: the token path, the
    same answer as the messages path. ``echo`` makes vLLM render the messages itself: messages."""
    c = server.client()
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital"}]
    for extra in ({"chat_template_kwargs": {"custom": 1}},
                  {"add_generation_prompt": False, "continue_final_message": True}):
        before = metric(server, "tokens", "")
        got = [c.chat.completions.create(model=TINY, messages=msgs, max_tokens=8, temperature=0,
                                         extra_body={**extra, "engine_input": ei}).choices[0].message.content
               for ei in ("tokens", "messages")]
        assert got[0] == got[1] and metric(server, "tokens", "") == before + 1
    before = metric(server, "messages", "field:echo")
    c.chat.completions.create(model=TINY, messages=msgs[:1], max_tokens=4, extra_body={"echo": True})
    assert metric(server, "messages", "field:echo") == before + 1


def test_what_vllm_normalizes_the_front_renders_alike(server):
    """What vLLM changes before its template sees a conversation (a tool result in text parts
    joined with newlines, Claude Code's billing line dropped from the system prompt, an empty
    ``tool_calls``, ``reasoning_content`` for ``reasoning``) the front does too: the prompt it
    counts is the one vLLM computes, and both paths answer alike."""
    msgs = [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.a1;"},
                                           {"type": "text", "text": "You are an agent."}]},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": None, "reasoning_content": "ls will do",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1",
             "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
            {"role": "assistant", "content": "Two files.", "tool_calls": []},
            {"role": "user", "content": "And now?"}]
    out = []
    for engine_input in ("tokens", "messages"):
        r = server.http().post("/v1/chat/completions", json={
            "model": TINY, "messages": msgs, "tools": CHAT_TOOLS, "max_tokens": 8, "temperature": 0,
            "engine_input": engine_input}, headers={"X-Session-Id": f"ei-{uuid.uuid4().hex[:12]}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["context_management"]["prompt_tokens_after"] == body["usage"]["prompt_tokens"]
        out.append((body["choices"][0]["message"], body["usage"]["prompt_tokens"]))
    assert out[0] == out[1]


def test_engine_input_is_validated(server):
    r = server.http().post("/v1/chat/completions", json={"model": TINY, "messages": [{"role": "user", "content": "x"}],
                                                         "engine_input": "ids"})
    assert r.status_code == 400 and "engine_input" in r.text


def _tokenize(server, body: dict) -> list[int]:
    """vLLM's own render of a chat request (the engine's ``/tokenize``)."""
    socket, secret = engine_of(server.proc.pid)

    async def ask():
        engine = EngineClient(socket.removeprefix("unix:"), secret)
        try:
            status, out = await engine.post_json("/tokenize", {**body, "model": TINY, "add_generation_prompt": True})
            assert status == 200, out
            return out["tokens"]
        finally:
            await engine.aclose()
    return asyncio.run(ask())


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_schema_that_differs_only_in_10_or_10_0_gets_its_own_render_across_keys(server, api):
    """Key 1 sends tools whose schema says ``"maximum": 10``; key 2 the same conversation with
    ``10.0`` (``true`` for a third): key 2's prompt is vLLM's render of key 2's request (the
    engine's ``/tokenize``), never key 1's (Python finds ``10 == 10.0 == True``)."""
    from conftest import OTHER_KEY

    def schema(value):
        return {"type": "object", "properties": {"n": {"type": "integer", "maximum": value}}}

    sid = uuid.uuid4().hex[:8]
    for key, value in ((API_KEY, 10), (OTHER_KEY, 10.0), (OTHER_KEY, True)):
        chat_tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": schema(value)}}]
        want = _tokenize(server, {"messages": [{"role": "user", "content": "hello"}], "tools": chat_tools})
        http = server.http(api_key=key)
        if api == "chat":
            r = http.post("/v1/chat/completions", json={
                "model": TINY, "messages": [{"role": "user", "content": "hello"}], "tools": chat_tools,
                "max_tokens": 2, "return_token_ids": True}, headers={"X-Session-Id": f"n-{sid}"})
            assert r.status_code == 200, r.text
            assert r.json()["prompt_token_ids"] == want
        elif api == "messages":
            r = http.post("/v1/messages", json={
                "model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}],
                "tools": [{"name": "f", "description": "d", "input_schema": schema(value)}]},
                headers={"X-Session-Id": f"n-{sid}"})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]   # Anthropic's input_tokens leave out what the cache read
            assert sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                                   "cache_creation_input_tokens")) == len(want)
        else:
            r = http.post("/v1/responses", json={
                "model": TINY, "input": "hello", "max_output_tokens": 16, "store": False,
                "tools": [{"type": "function", "name": "f", "description": "d", "parameters": schema(value)}]},
                headers={"X-Session-Id": f"n-{sid}"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] == len(want)
        assert r.json()["context_management"]["prompt_tokens_after"] == len(want)


def test_an_assistant_turn_with_null_content_renders_as_vllm_renders_it(server):
    """``content: null`` (and an assistant turn of only thinking blocks on /v1/messages): the front
    counts and sends vLLM's render (the engine's ``/tokenize``), on both paths alike."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "again"}]
    want = _tokenize(server, {"messages": msgs})
    for ei in ("tokens", "messages"):
        r = server.http().post("/v1/chat/completions", json={
            "model": TINY, "messages": msgs, "max_tokens": 2, "return_token_ids": True, "engine_input": ei})
        assert r.status_code == 200, r.text
        assert (r.json()["prompt_token_ids"] == want
                and r.json()["context_management"]["prompt_tokens_after"] == len(want))
    r = server.http().post("/v1/messages", json={"model": TINY, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}]},
        {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text


def test_a_conversation_the_template_refuses_is_a_400_in_each_apis_shape():
    """Many HF templates refuse a conversation (``raise_exception``): a 400 naming the request's
    conversation field, OpenAI's shape or Anthropic's, never a 500."""
    import jinja2
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from agentkv.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/{route:path}")
    def refuse(route: str):
        jinja2.Environment().from_string("{{ raise_exception('Conversation roles must alternate') }}").render(
            raise_exception=lambda m: (_ for _ in ()).throw(jinja2.TemplateError(m)))

    with TestClient(app) as c:
        chat, messages, responses = (c.post(f"/v1/{r}") for r in ("chat/completions", "messages", "responses"))
    assert chat.status_code == messages.status_code == responses.status_code == 400
    assert chat.json()["error"]["param"] == "messages" and responses.json()["error"]["param"] == "input"
    assert "roles must alternate" in chat.json()["error"]["message"]
    assert messages.json()["type"] == "error" and "roles must alternate" in messages.json()["error"]["message"]


def test_developer_messages_are_rendered_as_vllm_renders_them(server):
    """A template that does not know the developer role (the test model's): vLLM makes developer
    messages system ones and merges every system message into the first; the front sends vLLM's
    render of the client's messages, and counts it."""
    msgs = [{"role": "system", "content": "You are Codex."},
            {"role": "developer", "content": [{"type": "text", "text": "sandbox: read-only"},
                                              {"type": "text", "text": "approvals: never"}]},
            {"role": "user", "content": "List the files."},
            {"role": "developer", "content": "The user changed the sandbox."},
            {"role": "user", "content": "Go on."}]
    want = _tokenize(server, {"messages": msgs})
    answers = [server.http().post("/v1/chat/completions", json={
        "model": TINY, "messages": msgs, "max_tokens": 6, "temperature": 0, "engine_input": ei,
        "return_token_ids": True}).json() for ei in ("tokens", "messages")]
    assert answers[0]["choices"] == answers[1]["choices"]
    assert answers[0]["prompt_token_ids"] == answers[1]["prompt_token_ids"] == want
    assert answers[0]["context_management"]["prompt_tokens_after"] == len(want)
