"""The real server (vLLM + embedded model) driven with the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from agentkv.server import timing
from agentkv.server.config import ServeConfig

MODEL = "agentkv-tiny"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Random weights never choose a tool call on their own: constrain the output to one, so the real
# hermes tool parser of vLLM turns the generated text into `tool_calls`.
TOOL_CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}</tool_call>'


def greedy(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 12), **kw)


def test_models_lists_the_served_model(server):
    ids = [m.id for m in server.client().models.list()]
    assert ids == [MODEL]


def test_models_answers_codex_with_its_catalog_and_the_real_window(server):
    """Codex asks ``/models?client_version=...`` and reads a top-level ``models`` array of its
    ModelInfo (codex-rs protocol::openai_models): the served window, no instructions of ours."""
    plain = server.http().get("/v1/models").json()
    assert "models" not in plain
    r = server.http().get("/v1/models", params={"client_version": "0.171.0"})
    assert r.status_code == 200, r.text
    (info,) = r.json()["models"]
    window = plain["data"][0]["max_model_len"]
    assert info["slug"] == MODEL and info["context_window"] == window and "base_instructions" not in info
    assert info["auto_compact_token_limit"] == int(window * ServeConfig().compact_at)   # Codex's own compaction
    for field in ("display_name", "supported_reasoning_levels", "shell_type", "visibility", "supported_in_api",
                  "priority", "supports_reasoning_summaries", "support_verbosity", "truncation_policy",
                  "supports_parallel_tool_calls", "experimental_supported_tools"):
        assert field in info, field


def test_chat_non_stream_is_deterministic_and_reports_usage(server, renderer):
    client = server.client()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    a, b = greedy(client, msgs), greedy(client, msgs)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason in ("length", "stop")
    assert a.usage.prompt_tokens > 10
    assert 1 <= a.usage.completion_tokens <= 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == renderer.count(msgs)
    # the repeat is served from the prefix cache: every full block but the one holding the last token
    assert b.usage.prompt_tokens_details.cached_tokens == (b.usage.prompt_tokens - 1) // _block_size(server) * \
        _block_size(server)


def test_chat_stream_matches_non_stream_and_ends_with_usage(server):
    client = server.client()
    msgs = [{"role": "user", "content": "Count to five."}]
    full = greedy(client, msgs)
    chunks = list(greedy(client, msgs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1].choices == []
    assert [getattr(chunks[-1].usage, k) for k in counts] == [getattr(full.usage, k) for k in counts]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]


@pytest.mark.parametrize("stream", [False, True])
def test_server_timing_says_what_the_front_added(server, stream):
    """Server-Timing (W3C): the front's time before its engine request, which holds the context
    step, then the engine's to its response headers; a stream's header comes before its body."""
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0, stream=stream)
    spans = timing.parse(raw.headers["server-timing"])
    assert set(spans) == {"front", "engine", "context"}
    assert 0 < spans["context"] <= spans["front"] < 10_000 and spans["engine"] > 0
    if stream:
        assert any(c.choices for c in raw.parse())


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_stream_delivers_each_token_before_the_finishing_chunk(server, max_tokens):
    """Only the bare finish waits for the end of the stream (to carry the report): the tokens,
    the last one included (vLLM sends it in its finishing chunk), come in chunks before it."""
    msgs = [{"role": "user", "content": "Name a color."}]
    full = greedy(server.client(), msgs, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    r = server.http().post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "logprobs": True})
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")
              and line.strip() != "data: [DONE]"]
    *tokens, finish = events
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * len(tokens)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in tokens) == full.choices[0].message.content
    assert sum(len((c["choices"][0].get("logprobs") or {}).get("content") or []) for c in tokens) == max_tokens
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert finish["context_management"]["session_id"] == r.headers["x-session-id"]


def test_tool_call_round_trip(server, renderer):
    client = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = greedy(client, msgs, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=100,
                   extra_body={"structured_outputs": {"regex": TOOL_CALL_REGEX}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")

    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C, wind 3 m/s"}]
    second = greedy(client, msgs, tools=[WEATHER_TOOL])
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("length", "stop")
    assert second.usage.prompt_tokens == renderer.count(msgs, [WEATHER_TOOL])  # the call and result are in


def test_tool_call_streamed(server):
    stream = greedy(server.client(), [{"role": "user", "content": "Weather in Oslo?"}], stream=True,
                    tools=[WEATHER_TOOL], max_tokens=100,
                    extra_body={"structured_outputs": {"regex": TOOL_CALL_REGEX}})
    names, args, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(args)["city"] in ("Paris", "Rome", "Oslo")


def test_completions_endpoint(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    streamed = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True}, stream=True))
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def _block_size(server) -> int:
    """vLLM's KV block size, from its cache_config_info metric."""
    m = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', server.http().get("/metrics").text, re.M)
    assert m, "vllm:cache_config_info missing from /metrics"
    return int(m.group(1))


def _prefix_hits(server) -> float:
    text = server.http().get("/metrics").text
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "vllm:prefix_cache_hits_total missing from /metrics"
    return float(m.group(1))


def test_prefix_cache_hit_on_repeated_long_prompt(server):
    client = server.client()
    report = "\n".join(f"line {i}: service=media timeout_ms={1000 + i} code=E{2000 + i}" for i in range(120))
    msgs = [{"role": "user", "content": f"Tool report:\n{report}\nSummarize."}]
    before = _prefix_hits(server)
    first = greedy(client, msgs, max_tokens=2)
    second = greedy(client, msgs, max_tokens=2)
    assert first.usage.prompt_tokens > 512
    block = _block_size(server)
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // block * block
    assert _prefix_hits(server) >= before + second.usage.prompt_tokens_details.cached_tokens


def test_metrics_has_engine_and_front_families(server):
    text = server.http().get("/metrics").text
    assert "vllm:prefix_cache_queries_total" in text
    assert "agentkv_requests_total" in text and "agentkv_engine_up 1.0" in text


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
])
def test_bad_chat_request_gets_openai_style_400(server, body, param):
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_invalid_json_gets_400(server):
    r = server.http().post("/v1/chat/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=[])


def test_api_key_required_everywhere_but_health(server):
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
    for path in ("/v1/models", "/metrics"):
        r = server.http(api_key="wrong").get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


def test_unknown_model_is_a_clean_404(server):
    """In OpenAI's shape (vLLM's own names its exception class and an integer code)."""
    with pytest.raises(openai.NotFoundError) as err:
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.body == {"message": err.value.body["message"], "type": "not_found_error",   # as every 404
                              "param": "model", "code": "model_not_found"}
    assert "`nope` does not exist" in err.value.body["message"]
