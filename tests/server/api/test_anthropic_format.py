"""Anthropic Messages <-> agentkv's conversation (what the log stores) and the engine's messages;
the event encoder. No engine: these are the conversions themselves."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.server.api.messages.convert import chat_request, conversation, engine_message
from agentkv.server.api.messages.encode import EventStream, message
from agentkv.server.errors import APIError

from anthropic_log import rebuild, strip_cache

WORDS = st.text(alphabet="abc xyz\n", min_size=1, max_size=12)
CACHE = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])


def tool_uses_last(turn: dict) -> dict:
    """An assistant turn as the log gives it back: tool_use blocks after the others, per compaction segment."""
    if turn["role"] != "assistant" or isinstance(turn["content"], str):
        return turn
    out, seg = [], []
    for b in turn["content"] + [None]:
        if b is None or b["type"] == "compaction":
            out += [x for x in seg if x["type"] != "tool_use"] + [x for x in seg if x["type"] == "tool_use"]
            seg = []
            if b is not None:
                out.append(b)
        else:
            seg.append(b)
    return {**turn, "content": out}


@st.composite
def blocks(draw, role: str, n_tool: list[int]):
    text = st.builds(lambda t, c: {"type": "text", "text": t, **c}, WORDS, CACHE)
    if role == "assistant":
        kinds = st.one_of(
            text,
            st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "sig-" + t}, WORDS),
            st.builds(lambda t: {"type": "redacted_thinking", "data": "ZW5j" + t}, WORDS),
            st.builds(lambda t: {"type": "tool_use", "id": "", "name": "bash", "input": {"cmd": t}}, WORDS),
            st.builds(lambda t: {"type": "compaction", "content": t}, st.one_of(WORDS, st.none())))
        out = draw(st.lists(kinds, min_size=1, max_size=5))
        for b in out:
            if b["type"] == "tool_use":
                n_tool[0] += 1
                b["id"] = f"toolu_{n_tool[0]}"
        return out
    inner = st.lists(st.one_of(text, st.builds(lambda t: {"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": t}, "title": "T"}, WORDS)), min_size=1, max_size=2)
    result = st.builds(lambda c, e, cc: {"type": "tool_result", "tool_use_id": "toolu_x", "content": c, **e, **cc},
                       st.one_of(WORDS, inner), st.sampled_from([{}, {"is_error": True}, {"is_error": False}]), CACHE)
    search = st.builds(lambda t: {"type": "search_result", "source": "https://x", "title": "S",
                                  "content": [{"type": "text", "text": t}]}, WORDS)
    return draw(st.lists(st.one_of(text, result, search, inner.map(lambda x: x[0])), min_size=1, max_size=5))


@st.composite
def anthropic_requests(draw):
    n_tool = [0]
    system = draw(st.one_of(st.none(), WORDS, st.lists(st.builds(lambda t, c: {"type": "text", "text": t, **c},
                                                                 WORDS, CACHE), min_size=1, max_size=2)))
    msgs = []
    for i in range(draw(st.integers(1, 6))):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": draw(st.one_of(WORDS, blocks(role, n_tool)))})
        if draw(st.booleans()):
            msgs.append({"role": "system", "content": draw(WORDS)})
    return system, msgs


@settings(max_examples=150, deadline=None)
@given(req=anthropic_requests())
def test_the_log_keeps_every_block_whole(req):
    system, msgs = req
    conv = conversation(system, msgs)
    json.dumps(conv)                                                          # storable as it is
    got_system, got = rebuild(conv)
    assert got_system == strip_cache(system)
    assert got == [tool_uses_last(m) for m in strip_cache(msgs)]
    for m in conv:                                                            # the engine takes each
        e = engine_message(m)
        assert engine_message(e) == e                                         # idempotent
        assert set(e) <= {"role", "content", "tool_calls", "tool_call_id", "reasoning"}
        assert e["content"] is None or isinstance(e["content"], str)          # text only: one string


def test_engine_form_of_each_block():
    conv = conversation(
        [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
         {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        [{"role": "user", "content": [{"type": "text", "text": "ctx"}, {"type": "text", "text": "go"}]},
         {"role": "system", "content": "reminder"},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "plan", "signature": "s"}, {"type": "redacted_thinking", "data": "e"},
             {"type": "text", "text": "ok"}, {"type": "tool_use", "id": "t1", "name": "bash", "input": {"c": 1}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"type": "document", "title": "README", "source": {"type": "content", "content": [
                 {"type": "text", "text": "line 1"}]}}]},
         {"role": "assistant", "content": [{"type": "compaction", "content": "the summary"},
                                           {"type": "text", "text": "after"}]}])
    assert conv[0] == {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]}
    assert [engine_message(m) for m in conv] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "ctx\ngo"},
        {"role": "system", "content": "reminder"},
        {"role": "assistant", "content": "ok", "reasoning": "plan", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"c": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
        {"role": "user", "content": "README\n\nline 1"},
        {"role": "user", "content": "the summary"},
        {"role": "assistant", "content": "after"}]
    assert conv[4]["is_error"] is True                                        # kept in the log


@pytest.mark.parametrize("msgs, where", [
    ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": "iVBO"}}]}], "messages.0.content.1"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "read", "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
          {"type": "text", "text": "img:"}, {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}],
     "messages.2.content.0.content.1"),
    ([{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}], "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "web_search_tool_result", "tool_use_id": "w"}]}], "messages.0.content.0"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "bash", "input": {}}]}],
     "messages.0.content.0.id"),
])
def test_blocks_a_text_model_cannot_take_are_named(msgs, where):
    with pytest.raises(APIError) as err:
        conversation(None, msgs)
    assert err.value.status == 400 and err.value.param == where and where in err.value.message


def test_images_go_to_a_model_that_takes_them():
    conv = conversation(None, [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}],
        takes_images=True)
    assert engine_message(conv[0])["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]


def test_chat_request_maps_sampling_and_tool_choice_and_passes_vllm_extras():
    body = {"model": "m", "max_tokens": 9, "messages": [], "stop_sequences": ["END"], "temperature": 0.5,
            "top_k": 3, "tool_choice": {"type": "tool", "name": "bash", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 2048}, "output_config": {"effort": "high"},
            "metadata": {"user_id": "u"}, "context_management": {"edits": []}, "stream": True, "seed": 7}
    out = chat_request(body, "m")
    assert out == {"model": "m", "max_tokens": 9, "stream": True,
                   "temperature": 0.5, "top_k": 3, "stop": ["END"],
                   "tool_choice": {"type": "function", "function": {"name": "bash"}},
                   "parallel_tool_calls": False, "seed": 7}


def _chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def _replay(events: list[bytes]) -> dict:
    """The message a client assembles from the events (what the SDK's accumulator does)."""
    msg = None
    for raw in events:
        kind, data = raw.decode().split("\n")[:2]
        ev = json.loads(data[len("data: "):])
        assert kind == f"event: {ev['type']}"
        if ev["type"] == "message_start":
            msg = ev["message"]
        elif ev["type"] == "content_block_start":
            assert ev["index"] == len(msg["content"])
            msg["content"].append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            block, d = msg["content"][ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                block["_json"] = block.get("_json", "") + d["partial_json"]
            elif d["type"] == "compaction_delta":
                block["content"] = d["content"]
        elif ev["type"] == "content_block_stop":
            block = msg["content"][ev["index"]]
            if "_json" in block:
                block["input"] = json.loads(block.pop("_json"))
        elif ev["type"] == "message_delta":
            msg.update(ev["delta"])
            msg["usage"].update(ev["usage"])
    return msg


def test_events_assemble_to_the_json_response():
    """Reasoning, text and two tool calls as the engine streams them, against the same completion
    non-streamed: one encoder per side, the same message."""
    usage = {"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning": "let me "}),
              _chunk({"reasoning": "see"}), _chunk({"content": "Checking"}), _chunk({"content": " both."}),
              _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                      "function": {"name": "get", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
              _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                      "function": {"name": "get", "arguments": '{"city": "Rome"}'}}]}),
              _chunk(finish="tool_calls")]
    enc = EventStream("m", 50)
    events = [enc.start()] + [e for c in chunks for e in enc.chunk(c)] + enc.finish_events(usage, {"x": 1})
    streamed = _replay(events)
    payload = {"model": "m", "usage": usage, "choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Checking both.", "reasoning": "let me see", "tool_calls": [
            {"id": "call_a", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "function": {"name": "get", "arguments": '{"city": "Rome"}'}}]}}]}
    whole = message(payload, None, {"x": 1})
    assert streamed["content"] == whole["content"]
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert streamed["stop_reason"] == whole["stop_reason"] == "tool_use"
    assert streamed["usage"] == whole["usage"] == {"input_tokens": 18, "cache_read_input_tokens": 32,
                                                   "output_tokens": 9}
    assert json.loads(events[-2].decode().split("data: ")[1])["x"] == 1


def test_an_empty_answer_is_one_empty_text_block_both_ways():
    enc = EventStream("m", 5)
    events = [enc.start(), *enc.chunk(_chunk({"content": ""}, finish="length")), *enc.finish_events(None, {})]
    payload = {"model": "m", "choices": [{"finish_reason": "length", "message": {"content": ""}}]}
    assert _replay(events)["content"] == message(payload, None, {})["content"] == [{"type": "text", "text": ""}]
    assert _replay(events)["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("block, where", [
    ({"type": "text", "text": 5}, "messages.0.content.0.text"),
    ({"type": "tool_result", "tool_use_id": "t", "content": 7}, "messages.0.content.0.content"),
    ({"type": "document", "source": "a.txt"}, "messages.0.content.0.source"),
    ({"type": "search_result", "content": [{"type": "text", "text": None}]}, "messages.0.content.0.content.0.text"),
    ("just a string", "messages.0.content.0"),
])
def test_malformed_blocks_are_a_400_naming_the_field(block, where):
    with pytest.raises(APIError) as err:
        conversation(None, [{"role": "user", "content": [block]}])
    assert err.value.status == 400 and err.value.param == where
    with pytest.raises(APIError) as err:
        conversation([{"type": "text", "text": 1}], [{"role": "user", "content": "x"}])
    assert err.value.param == "system.0"
