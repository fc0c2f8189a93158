"""The Responses API on the real server (vLLM + the tiny model, 200k window) with the official openai
client: streamed and not, a function-call round trip, stored responses, sessions from the clients'
ids, compaction (threshold, /responses/compact, Codex's compaction_trigger), bad input, and a stream
whose engine dies."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import httpx
import openai
import pytest

from conftest import OTHER_KEY

MODEL = "agentkv-tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "current weather of a city", "strict": False,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# Random weights never choose a tool: constrain the output to a call, which vLLM's hermes parser reads.
FORCE_CALL = {"structured_outputs": {"regex": r'<tool_call>\{"name": "get_weather", "arguments": '
                                              r'\{"city": "(Paris|Rome|Oslo)"\}\}</tool_call>'}}


def sid() -> str:
    return f"resp-{uuid.uuid4().hex[:10]}"


def log_of(server, session: str) -> list[dict]:
    r = server.http().get(f"/v1/sessions/{session}/messages")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_create_streamed_and_not(wide_server):
    client = wide_server.client()
    rules = " ".join(f"Rule {i}: answer in few words." for i in range(60))   # long enough to be cached
    kw = {"model": MODEL, "instructions": rules, "input": "Say hi.", "max_output_tokens": 8,
          "temperature": 0, "store": False, "extra_body": {"min_tokens": 2}}   # its first token may end the turn
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert [o.type for o in whole.output] == ["message"] and whole.output_text
    assert 1 <= whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 5
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    again = client.responses.create(**kw)
    assert again.usage.input_tokens_details.cached_tokens > 0          # the prefix cache, reported
    events = events_of(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(wide_server, stream):
    client, session = wide_server.client(), sid()
    kw = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "store": False,
          "extra_headers": {"x-session-id": session}}
    question = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    if stream:
        with client.responses.stream(input=question, max_output_tokens=160, extra_body=FORCE_CALL, **kw) as s:
            events = list(s)
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done[0].arguments == first.output[-1].arguments
    else:
        first = client.responses.create(input=question, max_output_tokens=160, extra_body=FORCE_CALL, **kw)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    assert first.status == "completed"
    items = question + [o.model_dump(exclude_none=True) for o in first.output] + \
        [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(input=items, max_output_tokens=6, **kw)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens + 5        # the call and its output are in
    log = log_of(wide_server, session)
    assert log[0] == {"role": "user", "content": "Weather in Paris?"}
    assert (log[1]["tool_calls"][0]["id"] == call.call_id
            and log[1]["tool_calls"][0]["function"]["name"] == "get_weather")
    assert log[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}


def test_previous_response_id_continues_from_the_session_log(wide_server):
    client, session = wide_server.client(), sid()
    kw = {"model": MODEL, "max_output_tokens": 6, "temperature": 0, "extra_headers": {"x-session-id": session}}
    r1 = client.responses.create(input="first question", **kw)            # store defaults to true
    r2 = client.responses.create(input="second question", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id and r2.usage.input_tokens > r1.usage.input_tokens
    assert [(m["role"], m["content"]) for m in log_of(wide_server, session)] == \
        [("user", "first question"), ("assistant", r1.output_text), ("user", "second question")]
    assert client.responses.retrieve(r2.id).output_text == r2.output_text
    # a fork from r1 sees r1's conversation, not r2's: the same prompt as sending it all explicitly
    fork = client.responses.create(input="other question", previous_response_id=r1.id, **kw)
    explicit = client.responses.create(input=[{"role": "user", "content": "first question"},
                                              r1.output[0].model_dump(exclude_none=True),
                                              {"role": "user", "content": "other question"}],
                                       store=False, **kw)
    assert fork.usage.input_tokens == explicit.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="x", previous_response_id="resp_missing", **kw)
    with pytest.raises(openai.NotFoundError):                              # another key's response
        wide_server.client(api_key=OTHER_KEY).responses.create(input="x", previous_response_id=r1.id, model=MODEL)
    with pytest.raises(openai.NotFoundError):
        wide_server.client(api_key=OTHER_KEY).responses.retrieve(r1.id)


@pytest.mark.parametrize("headers, body, expected", [
    ({"session-id": "codex-s", "thread-id": "codex-t"}, {"prompt_cache_key": "codex-s"}, "codex-s"),   # Codex
    ({"thread-id": "codex-t"}, {"prompt_cache_key": "pck"}, "codex-t"),
    ({"session_id": "pi-1"}, {"prompt_cache_key": "pi-1"}, "pi-1"),                    # pi (id as cache key)
    ({}, {"session_id": "body-s", "prompt_cache_key": "pck"}, "body-s"),
    ({"x-session-id": "mine", "session-id": "codex-s"}, {"prompt_cache_key": "pck"}, "mine"),
])
def test_session_from_the_clients_ids(wide_server, headers, body, expected):
    suffix = uuid.uuid4().hex[:6]
    headers = {k: f"{v}-{suffix}" for k, v in headers.items()}
    body = {k: f"{v}-{suffix}" for k, v in body.items()}
    r = wide_server.http().post("/v1/responses", headers=headers, json={
        "model": MODEL, "input": "hello", "max_output_tokens": 2, "store": False, **body})
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == f"{expected}-{suffix}" == r.json()["context_management"]["session_id"]
    assert log_of(wide_server, f"{expected}-{suffix}") == [{"role": "user", "content": "hello"}]


def tool_session(rounds: int = 6, lines: int = 80) -> list[dict]:
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are an agent."}]},
             {"role": "user", "content": "Run the diagnostics."}]
    for i in range(rounds):
        out = "\n".join(f"service {i} check {j}: ok latency {j * 3} ms region eu-west-{j % 3}" for j in range(lines))
        items += [{"type": "function_call", "call_id": f"call_{i}", "name": "bash",
                   "arguments": json.dumps({"cmd": f"diag {i}"})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": out}]
    return items + [{"role": "user", "content": "Which services look slow?"}]


BASH = {"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


def test_compaction_threshold_then_continue_from_the_item(wide_server):
    client, session = wide_server.client(), sid()
    kw = {"model": MODEL, "tools": [BASH], "max_output_tokens": 4, "temperature": 0, "store": False,
          "context_management": [{"type": "compaction", "compact_threshold": 3000}],
          "extra_headers": {"x-session-id": session}}
    items = tool_session()
    r1 = client.responses.create(input=items, **kw)
    report = r1.model_extra["context_management"]
    assert [e["type"] for e in report["applied_edits"]] == ["compact"]
    assert report["prompt_tokens_before"] > 3000 > r1.usage.input_tokens
    # what vLLM counted, next to the front's count (the model's noise in the summary may tokenize
    # differently across message boundaries)
    assert abs(r1.usage.input_tokens - report["prompt_tokens_after"]) <= 16
    compaction, answer = r1.output
    assert compaction.type == "compaction" and compaction.encrypted_content.startswith("akv1.")
    # the client keeps its developer message and drops everything else before the compaction item
    nxt = [items[0], compaction.model_dump(exclude_none=True), answer.model_dump(exclude_none=True),
           {"role": "user", "content": "And now?"}]
    r2 = client.responses.create(input=nxt, **kw)
    assert r2.model_extra["context_management"]["applied_edits"] == []
    assert r1.usage.input_tokens < r2.usage.input_tokens < r1.usage.input_tokens + 40
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 128   # the same view, continued
    # stored instead: previous_response_id continues from the same compacted view
    kw.update(store=True, extra_headers={"x-session-id": sid()})
    s1 = client.responses.create(input=items, **kw)
    s2 = client.responses.create(input="And now?", previous_response_id=s1.id, **kw)
    assert s1.output[0].type == "compaction" and s2.model_extra["context_management"]["applied_edits"] == []
    assert s1.usage.input_tokens < s2.usage.input_tokens < s1.usage.input_tokens + 40
    assert s2.usage.input_tokens_details.cached_tokens >= s1.usage.input_tokens - 128
    tampered = dict(nxt[1], encrypted_content=compaction.encrypted_content[:-3] + "AAA")
    r = wide_server.http().post("/v1/responses", json={"model": MODEL, "input": [nxt[0], tampered]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.encrypted_content"
    other = wide_server.http(api_key=OTHER_KEY).post("/v1/responses", json={"model": MODEL, "input": nxt[:2]})
    assert other.status_code == 400 and other.json()["error"]["param"] == "input.1.encrypted_content"


def test_compact_endpoint_then_continue(wide_server):
    client = wide_server.client()
    items = tool_session()
    compacted = client.responses.compact(model=MODEL, input=items, extra_headers={"x-session-id": sid()})
    assert compacted.object == "response.compaction" and compacted.output[-1].type == "compaction"
    assert [o.content[0].text for o in compacted.output[:-1]] == ["Run the diagnostics.", "Which services look slow?"]
    assert compacted.usage.input_tokens > 3000 and compacted.usage.output_tokens > 0
    nxt = client.responses.create(model=MODEL,
                                  input=[items[0], *[o.model_dump(exclude_none=True, warnings=False)
                                                     for o in compacted.output],
                                         {"role": "user", "content": "Go on."}],
                                  max_output_tokens=4, store=False)
    assert nxt.usage.input_tokens < compacted.usage.input_tokens / 2


def test_codex_remote_compaction_trigger(wide_server):
    """Codex's remote compaction V2: a streamed request ending with compaction_trigger gets exactly
    one output item, the compaction item."""
    items = tool_session(rounds=3) + [{"type": "compaction_trigger"}]
    events = events_of(wide_server.client().responses.create(model=MODEL, input=items, stream=True, store=False,
                                                               extra_headers={"session-id": sid()}))
    assert [e.type for e in events[2:]] == ["response.output_item.added", "response.output_item.done",
                                            "response.completed"]
    (item,) = events[-1].response.output
    assert item.type == "compaction" and item.encrypted_content == events[3].item.encrypted_content


@pytest.mark.parametrize("stream", [False, True])
def test_server_tools_run_inside_a_response(wide_server, stream):
    """The shared engine step: the model's recall call is run by the server and generation goes on;
    the client sees the answer and server_tool_calls, never the call itself."""
    items = tool_session(rounds=2, lines=10)
    items[3]["output"] += "\nmedia timeout_ms = 1050"
    recall = r'<tool_call>\{"name": "recall", "arguments": \{"query": "media timeout"\}\}</tool_call>'
    # greedy, with room for the call however it is tokenized (a regex constrains characters, not
    # tokens: a sampled run once spelled it in more than 60 tokens and ended incomplete)
    r = wide_server.http().post("/v1/responses", headers={"x-session-id": sid()}, json={
        "model": MODEL, "input": items, "tools": [BASH], "max_output_tokens": 160, "temperature": 0, "store": False,
        "stream": stream, "server_tools": True, "structured_outputs": {"regex": recall}})
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert "response.function_call_arguments.delta" not in [e["type"] for e in events]
        r_json = events[-1]["response"]
    else:
        r_json = r.json()
    assert "server_tool_calls" in r_json, r_json
    (call,) = r_json["server_tool_calls"]
    assert call["name"] == "recall" and "timeout_ms = 1050" in call["result"]
    assert [o["type"] for o in r_json["output"]] == ["message"]


def test_tools_the_server_cannot_run_are_not_offered(wide_server):
    r = wide_server.http().post("/v1/responses", json={
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False,
        "tools": [BASH, {"type": "web_search", "external_web_access": False},
                  {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                   "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["tools_not_offered"] == ["web_search"] and len(r.json()["tools"]) == 3


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": "x"}, {"type": "shell_call", "id": "s"}]}, "input.1.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input.0.content.0.type"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "context_management": [{"type": "compaction", "compact_threshold": 0}]}, "context_management"),
    ({"input": "x", "background": True}, "background"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(wide_server, body, param):
    session = sid()
    r = wide_server.http().post("/v1/responses", headers={"x-session-id": session}, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param) and err["message"]
    assert wide_server.http().get(f"/v1/sessions/{session}").status_code == 404     # nothing was logged


def test_compaction_checks_the_model_name(wide_server):
    with pytest.raises(openai.NotFoundError):
        wide_server.client().responses.compact(model="nope", input="hello")


def _engine_pid(server) -> int:
    import psutil

    for p in psutil.Process(server.proc.pid).children(recursive=True):
        if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
            return p.pid
    raise AssertionError("no vLLM engine under the server")


def _health(server, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == want:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"/health never answered {want}\n{server.log_tail()}")


@pytest.mark.last  # kills wide_server's engine: after every other test on it
def test_engine_dying_mid_stream_is_response_failed(wide_server):
    for _ in range(3):   # a stream that ended before the kill landed proves nothing: kill again
        _health(wide_server, 200, 600)
        stream = wide_server.client(timeout=120).responses.create(
            model=MODEL, input="count to a thousand", stream=True, store=False, max_output_tokens=8000,
            extra_body={"ignore_eos": True})
        events = []
        for event in stream:
            events.append(event)
            if len(events) == 8:
                os.killpg(_engine_pid(wide_server), signal.SIGKILL)
        if events[-1].type == "response.failed":
            break
    assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert "engine" in events[-1].response.error.message
    assert "response.completed" not in [e.type for e in events]
    _health(wide_server, 200, 900)   # restarted: the fixture's teardown finds it healthy
