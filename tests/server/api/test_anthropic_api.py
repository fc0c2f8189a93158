"""The Anthropic Messages API on the real server (vLLM + embedded model), driven with the official
anthropic SDK: streams against non-streamed answers, Anthropic's context-management edits by their
names, every content block in the session log, count_tokens, server tools, sessions."""

from __future__ import annotations

import json
import uuid

import anthropic
import pytest

from anthropic_log import rebuild, strip_cache
from conftest import API_KEY

MODEL = "agentkv-tiny"
BETA = ["context-management-2025-06-27"]
FACT = "timeout_ms = 1050"
TOOLS = [{"name": "bash", "description": "run a command",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
# random weights never call a tool on their own: constrain the output to a call, which vLLM's hermes
# parser turns into a tool call (structured_outputs is vLLM's own field: unknown fields pass through)
BASH_CALL = r'<tool_call>\{"name": "bash", "arguments": \{"cmd": "(ls|pwd)"\}\}</tool_call>'
# the SDK no longer offers sampling parameters; agentkv still maps Anthropic's temperature to vLLM's
GREEDY = {"temperature": 0}
RECALL_CALL = r'<tool_call>\{"name": "recall", "arguments": \{"query": "timeout"\}\}</tool_call>'


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=600)


def diag() -> list[dict]:
    out = "\n".join(f"media check {j}: ok" for j in range(80)) + f"\n{FACT}"
    return [{"role": "user", "content": "check media"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "bash",
                                               "input": {"cmd": "diag"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": out}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu2", "name": "bash",
                                               "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu2", "content": "a.py"},
                                         {"type": "text", "text": "what is slow?"}]}]


def log_of(server, sid: str) -> list[dict]:
    r = server.http().get(f"/v1/sessions/{sid}/messages")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_messages_with_the_anthropic_client(server):
    c = client(server)
    msg = c.messages.create(model=MODEL, max_tokens=8, system="You are an agent.", messages=diag(), tools=TOOLS)
    assert msg.role == "assistant" and msg.content and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 50


def _without_ids(blocks) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("forced", [None, BASH_CALL], ids=["text", "tool_use"])
def test_stream_equals_the_non_streamed_answer(server, forced):
    c = client(server)
    kw = dict(model=MODEL, max_tokens=60 if forced else 16, system="You are terse.",
              messages=[{"role": "user", "content": f"List the files. {uuid.uuid4()}"}], tools=TOOLS,
              extra_body=GREEDY | ({"structured_outputs": {"regex": forced}} if forced else {}))
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert _without_ids(final.content) == _without_ids(whole.content)            # greedy: the same answer
    assert final.stop_reason == whole.stop_reason == ("tool_use" if forced else final.stop_reason)
    assert final.usage.output_tokens == whole.usage.output_tokens >= 1
    prompt = [u.input_tokens + (u.cache_read_input_tokens or 0) for u in (final.usage, whole.usage)]
    assert prompt[0] == prompt[1] > 20
    if forced:
        assert [b.type for b in whole.content] == ["tool_use"]
        assert whole.content[0].name == "bash" and whole.content[0].input["cmd"] in ("ls", "pwd")
    else:
        assert text == whole.content[0].text


def thinking_conversation() -> list[dict]:
    msgs = []
    for i in range(3):
        msgs += [{"role": "user", "content": f"question {i}"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": f"reasoning {i} " * 10, "signature": f"sig{i}"},
                     {"type": "redacted_thinking", "data": f"ZW5j{i}"},
                     {"type": "text", "text": f"answer {i}"}]}]
    return msgs + [{"role": "user", "content": "and now?"}]


EDITS = {
    "clear_tool_uses_20250919": ({"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                                  "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["bash"]}, diag),
    "clear_tool_uses_on_tool_uses": ({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                                      "keep": {"type": "tool_uses", "value": 1}}, diag),
    "clear_thinking_20251015": ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                                thinking_conversation),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", EDITS)
def test_official_edits_through_the_sdk(server, name, stream):
    edit, conv = EDITS[name]
    c, sid = client(server), f"e-{uuid.uuid4().hex[:8]}"
    kw = dict(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=conv(), tools=TOOLS, betas=BETA,
              context_management={"edits": [edit]}, extra_headers={"X-Session-Id": sid})
    if stream:
        with c.beta.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = c.beta.messages.create(**kw)
    cm = msg.context_management
    (applied,) = cm.applied_edits
    assert applied.type == edit["type"]
    extra = cm.model_extra
    assert extra["session_id"] == sid
    if edit["type"] == "clear_tool_uses_20250919":
        assert applied.cleared_tool_uses == 1 and applied.cleared_input_tokens > 100
        assert extra["prompt_tokens_before"] - extra["prompt_tokens_after"] == applied.cleared_input_tokens
        assert applied.model_extra["edits"]                                      # agentkv's own, beside
    else:
        # the tiny model's template does not render reasoning: 2 turns cleared, no tokens freed
        assert applied.cleared_thinking_turns == 2 and applied.cleared_input_tokens == 0
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert prompt == extra["prompt_tokens_after"]                                # what vLLM got
    assert rebuild(log_of(server, sid))[1] == conv()                             # the log keeps the originals


def test_every_content_block_is_logged_whole(server):
    sid = f"b-{uuid.uuid4().hex[:8]}"
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=1f2e;"},
              {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "read the docs",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Agents available: Explore."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read it.", "signature": "EqQBCkYIBxgCKkA"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/r/README.md"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True,
             "content": [{"type": "text", "text": "<tool_use_error>File does not exist.</tool_use_error>"}]},
            {"type": "document", "title": "notes.txt", "context": "from the user",
             "source": {"type": "text", "media_type": "text/plain", "data": "port = 8443"}},
            {"type": "search_result", "source": "https://docs.example/x", "title": "X",
             "content": [{"type": "text", "text": "X is a thing."}]},
            {"type": "text", "text": "go on"}]},
        {"role": "assistant", "content": [{"type": "compaction", "content": None}]},
        {"role": "user", "content": "still there?"}]
    r = server.http().post("/v1/messages?beta=true", headers={"X-Session-Id": sid}, json={
        "model": MODEL, "max_tokens": 4, "system": system, "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    got_system, got = rebuild(log_of(server, sid))
    assert got_system == [{"type": "text", "text": "You are an agent."}]        # the billing line is request metadata
    assert got == strip_cache(msgs)


@pytest.mark.parametrize("content, where", [
    ([{"type": "text", "text": "what is this?"},
      {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}],
     "messages.0.content.1"),
    ([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}],
     "messages.0.content.0"),
])
def test_a_block_the_model_cannot_take_is_a_400_naming_it_and_nothing_is_logged(server, content, where):
    sid = f"i-{uuid.uuid4().hex[:8]}"
    with pytest.raises(anthropic.BadRequestError) as err:
        client(server).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}],
                                       extra_headers={"X-Session-Id": sid}, stream=True)
    body = err.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(where)
    assert server.http().get(f"/v1/sessions/{sid}").status_code == 404


def test_an_image_inside_a_tool_result_is_named_too(server):
    msgs = diag()
    msgs[2]["content"][0]["content"] = [{"type": "text", "text": "screenshot:"}, {"type": "image", "source": {
        "type": "url", "url": "https://example.com/s.png"}}]
    r = server.http().post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.2.content.0.content.1")


def claude_code_body(session: str, **over) -> dict:
    """The shape of Claude Code's request (as captured from 2.1.197, tools shortened)."""
    return {"model": MODEL, "max_tokens": 8, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.123;"},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Available agent types: Explore."}],
            "tools": TOOLS, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": json.dumps({"device_id": "d0", "account_uuid": "", "session_id": session})},
            **over}


CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "context-management-2025-06-27,mid-conversation-system-2026-04-07,"
                                    "some-future-beta-2027-01-01",
                  "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2048}])
def test_claude_codes_request_streams_without_an_error_event(server, thinking):
    session = str(uuid.uuid4())
    r = server.http().post("/v1/messages?beta=true", json=claude_code_body(session, thinking=thinking),
                           headers={**CLAUDE_HEADERS, "x-claude-code-session-id": session})
    assert r.status_code == 200, r.text
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "error" not in kinds
    assert r.headers["x-session-id"] == session
    delta = json.loads(r.text.split("event: message_delta\ndata: ")[1].split("\n")[0])
    assert delta["context_management"]["applied_edits"] == []                   # keep: all clears nothing
    assert [m["role"] for m in log_of(server, session)] == ["system", "user", "system"]


def test_metadata_session_id_keys_the_session_without_the_header(server):
    session = str(uuid.uuid4())
    r = server.http().post("/v1/messages", json=claude_code_body(session, stream=False))
    assert r.status_code == 200 and r.headers["x-session-id"] == session


def test_unknown_edit_type_is_a_400_naming_it_and_listing_the_supported_types(server):
    with pytest.raises(anthropic.BadRequestError) as err:
        client(server).beta.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                            betas=BETA, context_management={"edits": [
                                                {"type": "clear_tool_uses_20250919"}, {"type": "forget_all_20990101"}]})
    body = err.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert "context_management.edits.1.type" in message and "forget_all_20990101" in message
    for name in ("clear_tool_uses_20250919", "clear_thinking_20251015", "compact_20260112", "clear_tool_uses"):
        assert repr(name) in message


def test_count_tokens_equals_what_the_engine_is_given(server):
    c = client(server)
    bare = [{"name": "pwd", "input_schema": {"type": "object", "properties": {}}}]   # vLLM renders a null description
    kw = dict(model=MODEL, system="You are an agent.", messages=diag(), tools=TOOLS + bare)
    counted = c.messages.count_tokens(**kw)
    msg = c.messages.create(max_tokens=2, **kw)
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    clear = {"edits": [EDITS["clear_tool_uses_20250919"][0]]}
    edited = c.beta.messages.count_tokens(betas=BETA, context_management=clear, **kw)
    sid = f"c-{uuid.uuid4().hex[:8]}"
    managed = c.beta.messages.create(max_tokens=2, betas=BETA, context_management=clear,
                                     extra_headers={"X-Session-Id": sid}, **kw)
    assert edited.context_management.original_input_tokens == counted.input_tokens
    assert edited.input_tokens == managed.context_management.model_extra["prompt_tokens_after"] < counted.input_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_server_executed_recall_finds_a_cleared_fact(server, stream):
    sid = f"r-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "max_tokens": 160, "temperature": 0, "messages": diag(), "tools": TOOLS, "stream": stream,
            "server_tools": True, "structured_outputs": {"regex": RECALL_CALL},
            "context_management": {"edits": [EDITS["clear_tool_uses_20250919"][0]]}}
    r = server.http().post("/v1/messages", headers={"X-Session-Id": sid}, json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert "event: error" not in r.text
        final = next(e for e in events if e["type"] == "message_delta")
        blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    else:
        final = r.json()
        blocks = final["content"]
    (call,) = final["server_tool_calls"]
    assert call["name"] == "recall" and FACT in call["result"]
    assert not any(b["type"] == "tool_use" for b in blocks)                     # run by the server
    assert final["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 1


def test_note_tool_on_messages(server):
    sid = f"n-{uuid.uuid4().hex[:8]}"
    regex = r'<tool_call>\{"name": "note", "arguments": \{"kind": "decision", "text": "use port 8443"\}\}</tool_call>'
    r = server.http().post("/v1/messages", headers={"X-Session-Id": sid}, json={
        "model": MODEL, "max_tokens": 150, "messages": [{"role": "user", "content": "decide"}],
        "server_tools": True, "structured_outputs": {"regex": regex}})
    assert r.json()["server_tool_calls"][0]["result"] == "noted"
    assert server.http().get(f"/v1/sessions/{sid}").json()["notes"] == [{"kind": "decision", "text": "use port 8443"}]


def test_two_conversations_sharing_their_first_messages_stay_two_sessions(server):
    """No session id from the client: the id is derived from the first system and user message,
    which both conversations share; the second must fork, not append to the first."""
    c = client(server)
    system, first = f"You are agent {uuid.uuid4()}.", {"role": "user", "content": "hello"}

    def send(msgs):
        raw = c.messages.with_raw_response.create(model=MODEL, max_tokens=2, system=system, messages=msgs)
        return raw.headers["x-session-id"]

    a = [first, {"role": "assistant", "content": "fixing the build"}, {"role": "user", "content": "go on"}]
    b = [first, {"role": "assistant", "content": "writing the docs"}, {"role": "user", "content": "go on"}]
    ids = [send([first]), send([first]), send(a), send(b), send(a + [{"role": "assistant", "content": "ok"},
                                                                    {"role": "user", "content": "done?"}])]
    assert ids[0] == ids[1] == ids[2] == ids[4] and ids[0].startswith("auto-")
    assert ids[3] != ids[0] and ids[3].rsplit(".", 1)[0] == ids[0].rsplit(".", 1)[0]   # a fork of its own
    sa, sb = rebuild(log_of(server, ids[0])), rebuild(log_of(server, ids[3]))
    assert sa == (system, a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "done?"}])
    assert sb == (system, b)


def test_engine_refusal_of_a_stream_is_an_anthropic_error_before_any_event(server):
    # a sampling value vLLM refuses (an output limit over the window is lowered, not refused: test_window.py)
    r = server.http().post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "stream": True, "top_k": -7,
                                                 "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["type"] == "error" and "top_k" in r.json()["error"]["message"]


def test_messages_bad_input_gets_anthropic_error(server):
    r = server.http().post("/v1/messages", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def long_conversation(services: int = 30) -> list[dict]:
    """About 55k prompt tokens with the tiny tokenizer: over compact_20260112's minimum trigger."""
    msgs = [{"role": "user", "content": "Run every diagnostic."}]
    for i in range(services):
        out = "\n".join(f"svc{i} check {j}: ok latency {j * 3} ms" for j in range(100))
        msgs += [{"role": "assistant", "content": [
                     {"type": "tool_use", "id": f"tu{i}", "name": "bash", "input": {"cmd": f"diag {i}"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu{i}", "content": out}]}]
    msgs[-1]["content"].append({"type": "text", "text": "Which services are slow?"})
    return msgs


def test_compact_20260112_answers_with_a_compaction_block_that_replaces_what_came_before(wide_server):
    c, msgs = client(wide_server), long_conversation()
    compact = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}
    kw = dict(model=MODEL, max_tokens=4, extra_body=GREEDY, system="You are an agent.", tools=TOOLS,
              betas=BETA + ["compact-2026-01-12"], context_management={"edits": [compact]})
    assert c.messages.count_tokens(model=MODEL, system="You are an agent.", tools=TOOLS,
                                   messages=msgs).input_tokens > 50_000
    sids = [f"k-{uuid.uuid4().hex[:8]}" for _ in range(4)]
    first = c.beta.messages.create(messages=msgs, extra_headers={"X-Session-Id": sids[0]}, **kw)
    with c.beta.messages.stream(messages=msgs, extra_headers={"X-Session-Id": sids[1]}, **kw) as s:
        streamed = s.get_final_message()
    for msg in (first, streamed):
        block = msg.content[0]
        assert block.type == "compaction" and block.content.startswith("[conversation summary]")
        assert [b.type for b in msg.content[1:]] == ["text"]
        # Anthropic reports compaction by the block alone; agentkv also lists it in applied_edits,
        # which the SDK's types do not know (it keeps the fields as they came)
        (applied,) = msg.context_management.to_dict(warnings=False)["applied_edits"]
        # everything after the system prompt (the last turn is two log messages: a tool result, a text)
        assert applied["type"] == "compact_20260112" and applied["summarized_messages"] == len(msgs) + 1
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens < 5000   # the engine got the summary
    assert streamed.content[0].content == first.content[0].content                 # greedy: the same summary

    # the client sends the block back: what it replaces is dropped, and the prefix cache still hits
    more = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": "And now?"}]
    second = c.beta.messages.create(messages=more, extra_headers={"X-Session-Id": sids[0]}, **kw)
    extra = second.context_management.model_extra
    assert second.context_management.applied_edits == [] and extra["prompt_tokens_after"] < 5000
    assert second.usage.cache_read_input_tokens > 0
    assert rebuild(log_of(wide_server, sids[0]))[1][-2]["content"][0] == {"type": "compaction",
                                                                           "content": first.content[0].content}
    # the same client-sent block on a session that never compacted (e.g. another replica's) drops the same
    other = c.beta.messages.create(messages=more, extra_headers={"X-Session-Id": sids[2]}, **kw)
    assert other.context_management.model_extra["prompt_tokens_after"] == extra["prompt_tokens_after"]

    paused = c.beta.messages.create(messages=msgs, extra_headers={"X-Session-Id": sids[3]},
                                    **{**kw, "context_management": {"edits": [{**compact,
                                                                               "pause_after_compaction": True}]}})
    assert paused.stop_reason == "compaction" and [b.type for b in paused.content] == ["compaction"]
    assert paused.content[0].content == first.content[0].content
    # in a thread, a paused response is stored like any other: the thread goes on from it
    threaded = {**kw, "betas": kw["betas"] + ["message-threads-2026-08-12"],
                "context_management": {"edits": [{**compact, "pause_after_compaction": True}]}}
    created = c.beta.messages.create(messages=msgs, thread={"type": "create"}, **threaded)
    assert created.stop_reason == "compaction"
    went_on = c.beta.messages.create(messages=[{"role": "user", "content": "Which one first?"}],
                                     thread={"type": "continue", "previous_message_id": created.id}, **threaded)
    assert went_on.context_management.model_extra["prompt_tokens_after"] < 5000   # on the summary
