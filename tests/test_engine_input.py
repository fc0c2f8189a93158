"""Token ids to vLLM (``--engine-input tokens``, the default): every API's answer through the
token-in path equals the messages path's (the request's ``engine_input: "messages"``) token for
token, streamed and not, greedy text and tool calls, on the test model and the embedded SmolLM2;
requests whose render the front cannot vouch for go as messages and are counted by why; the
front's render is checked against the engine's own before it is trusted."""

from __future__ import annotations

import asyncio
import uuid

import anthropic
import pytest
from conftest import API_KEY, REAL, TINY

from agentkv.benchmarks.front import engine_of
from agentkv.compaction.prompt import PromptRenderer, engine_tools
from agentkv.server.embedded_model.catalog import model_dir
from agentkv.server.engine.client import EngineClient
from agentkv.server.pipeline.engine_input import PROBE, PROBE_TOOLS, EngineInput

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
    return ([(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in r.content],
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


def test_a_field_that_changes_vllms_render_goes_as_messages(server):
    """chat_template_kwargs reach vLLM's template, which the front renders without: such a request
    goes as messages (vLLM renders it), counted by the field; the answer is the same as without."""
    before = metric(server, "messages", "field:chat_template_kwargs")
    c = server.client()
    kw = dict(model=TINY, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    with_kwargs = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {}}).choices[0].message.content
    assert with_kwargs == plain
    assert metric(server, "messages", "field:chat_template_kwargs") == before + 1


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
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
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


def test_tools_are_rendered_as_vllm_dumps_them():
    """The front gives the template each tool as vLLM's own request model dumps it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    tools = CHAT_TOOLS + [{"type": "function", "defer_loading": True, "function": {"name": "x", "strict": True}},
                          {"function": {"name": "y", "parameters": {}, "defer_loading": False}}]
    assert engine_tools(tools) == [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]


def test_the_front_render_is_checked_against_the_engines(server):
    """Before the first token-in request the front's render of a probe conversation is compared
    with the engine's own: the served model's renderer passes, rendering by segments or whole;
    another model's (SmolLM2's template and tokenizer against the test model's engine) fails, and
    then every request goes as messages."""
    if not (model_dir(REAL) / "tokenizer.json").exists():
        pytest.skip(f"{REAL} is not built here (./setup.sh builds it)")
    socket, secret = engine_of(server.proc.pid)

    async def check(path, segments: bool = True) -> tuple[bool, str | None]:
        engine = EngineClient(socket.removeprefix("unix:"), secret)
        try:
            ei = EngineInput("tokens", PromptRenderer.from_pretrained(str(path), segments=segments), TINY)
            ok = await ei.check(engine)
            make = await ei.for_turn(engine, {"messages": PROBE, "tools": PROBE_TOOLS}, None)
            return ok, (await make({"messages": PROBE})).get("kv_transfer_params")
        finally:
            await engine.aclose()

    tiny = model_dir(TINY)
    ok, kv = asyncio.run(check(tiny))
    assert ok and kv["prompt_token_ids"]
    # rendering whole conversations (templates that do not render message by message): the same ids
    assert asyncio.run(check(tiny, segments=False)) == (ok, kv)
    ok, kv = asyncio.run(check(model_dir(REAL)))
    assert not ok and kv is None
    assert metric(server, "messages", "render_mismatch") == 0   # the server's own render passed its check


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
    """A template that does not know the developer role (the test model's, SmolLM2's): vLLM makes
    developer messages system ones and merges every system message into the first. The front
    sends what vLLM would render, so its ids are vLLM's render of the client's messages."""
    from agentkv.compaction.prompt import developer_as_system

    socket, secret = engine_of(server.proc.pid)
    msgs = [{"role": "system", "content": "You are Codex."},
            {"role": "developer", "content": [{"type": "text", "text": "sandbox: read-only"},
                                              {"type": "text", "text": "approvals: never"}]},
            {"role": "user", "content": "List the files."},
            {"role": "developer", "content": "The user changed the sandbox."},
            {"role": "user", "content": "Go on."}]

    async def both() -> tuple[list[int], list[int]]:
        engine = EngineClient(socket.removeprefix("unix:"), secret)
        try:
            _, theirs = await engine.post_json("/tokenize", {"model": TINY, "messages": msgs,
                                                             "add_generation_prompt": True})
        finally:
            await engine.aclose()
        renderer = PromptRenderer.from_pretrained(str(model_dir(TINY)))
        assert not renderer.takes_developer
        return renderer.render(developer_as_system(msgs)).token_ids, theirs["tokens"]

    mine, theirs = asyncio.run(both())
    assert mine == theirs
    answers = [server.http().post("/v1/chat/completions", json={
        "model": TINY, "messages": msgs, "max_tokens": 6, "temperature": 0, "engine_input": ei}).json()
        for ei in ("tokens", "messages")]
    assert answers[0]["choices"] == answers[1]["choices"] and answers[0]["usage"]["prompt_tokens"] == len(theirs)


@pytest.mark.parametrize("template, args, model_type, why", [
    ("{{ strftime_now('%Y') }}{{ messages }}", (), "llama", "reads the clock"),
    ("{{ messages }}", ("--chat-template=/x.jinja",), "llama", "--chat-template"),
    ("{{ messages }}", ("--default-chat-template-kwargs", "{}"), "llama", "--default-chat-template-kwargs"),
    ("{{ messages }}", (), "gpt_oss", "harmony"),
    ("{{ messages }}", ("--max-num-seqs=8",), "llama", None),
])
def test_what_the_front_cannot_render_alike_is_known_before_asking(template, args, model_type, why):
    from agentkv.server.pipeline.engine_input import known_mismatch

    found = known_mismatch(template, args, model_type)
    assert (found is None) if why is None else (why in found)
