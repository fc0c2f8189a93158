"""Responses items <-> chat messages, output items and events, compaction items (no engine)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given, settings
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentkv.server.api.responses.convert import to_chat_tool_choice, to_chat_tools, to_messages
from agentkv.server.api.responses.encode import (
    EventStream,
    OutputBuilder,
    finish_response,
    to_usage,
    whole_message_delta,
)
from agentkv.server.errors import APIError
from agentkv.server.pipeline.compaction_item import CompactionSeal, load_key

from agent_sessions import conversations

SEAL = CompactionSeal(b"k" * 32)
EVENT = TypeAdapter(ResponseStreamEvent)


def opener(owner: str = "o"):
    return lambda item, where: SEAL.open(owner, item, where)


def as_items(msgs: list[dict]) -> list[dict]:
    """A chat conversation as the Responses items a client sends (assistant turns as our output)."""
    items: list[dict] = []
    for m in msgs:
        if m["role"] == "assistant":
            b = OutputBuilder({})
            b.feed(whole_message_delta(m))
            b.finish()
            items += b.items
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"type": "message", "role": m["role"],
                          "content": [{"type": "input_text", "text": m["content"]}]})
    return items


def merged(msgs: list[dict]) -> list[dict]:
    """Items cannot tell an assistant message from the tool calls right after it: those calls
    belong to it (as in our own output, a message item then function_call items)."""
    out: list[dict] = []
    for m in msgs:
        if out and out[-1]["role"] == "assistant" and m["role"] == "assistant" and m["content"] is None:
            out[-1] = {**out[-1], "tool_calls": out[-1].get("tool_calls", []) + m["tool_calls"]}
        else:
            out.append(m)
    return out


@settings(max_examples=60, deadline=None)
@given(msgs=conversations())
def test_items_round_trip_to_the_same_chat_messages(msgs):
    assert to_messages(as_items(msgs), opener()).messages == merged(msgs)


def test_codex_shaped_input():
    items = [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "fix it"},                          # type left out
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look first"}],
         "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"},
        {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    assert to_messages(items, opener(), prior=[{"role": "user", "content": "before"}]).messages == [
        {"role": "user", "content": "before"},
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": None, "reasoning": "look first", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "multi_agent_v1.spawn_agent", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]
    assert to_messages("hello", opener()).messages == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("items, param", [
    ([{"type": "message", "role": "user", "content": "x"}, {"type": "web_search_call", "id": "w"}], "input.1.type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
    ([{"foo": 1}], "input.0.type"),
    ([{"type": "message", "role": "wizard", "content": "x"}], "input.0.role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}], "input.0.content.0.type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ([{"type": "compaction_trigger"}, {"role": "user", "content": "x"}], "input.0.type"),
])
def test_bad_items_are_400_naming_the_field(items, param):
    with pytest.raises(APIError) as err:
        to_messages(items, opener())
    assert err.value.status == 400 and err.value.param == param


def test_compaction_item_replaces_what_came_before_and_is_authenticated():
    summary = [{"role": "user", "content": "[conversation summary] ..."}, {"role": "user", "content": "recent"}]
    item = SEAL.item("o", summary)
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    items = [{"role": "system", "content": "sys"}, {"role": "user", "content": "old"},
             {"type": "message", "role": "assistant", "content": "old answer"}, item,
             {"role": "user", "content": "next"}]
    out = to_messages(items, opener())
    assert out.compacted and out.messages == [{"role": "system", "content": "sys"}, *summary,
                                              {"role": "user", "content": "next"}]
    version, payload, tag = item["encrypted_content"].split(".")
    flipped = payload[:10] + ("A" if payload[10] != "A" else "B") + payload[11:]
    for bad, owner in [(f"{version}.{flipped}.{tag}", "o"), ("made-up", "o"), (f"{version}.{payload}.{tag}\u00e9", "o"),
                       (item["encrypted_content"], "someone-else"),
                       (CompactionSeal(b"x" * 32).item("o", summary)["encrypted_content"], "o")]:
        with pytest.raises(APIError) as err:
            to_messages([{"role": "user", "content": "a"}, {"type": "compaction", "encrypted_content": bad}],
                        opener(owner))
        assert err.value.status == 400 and err.value.param == "input.1.encrypted_content"


def test_key_is_made_once_owner_only(tmp_path):
    key = load_key(tmp_path)
    assert len(key) == 32 and load_key(tmp_path) == key
    assert stat.S_IMODE(os.stat(tmp_path / "compaction.key").st_mode) == 0o600


def test_tools_function_namespace_and_hosted():
    tools = to_chat_tools([
        {"type": "function", "name": "exec_command", "description": "run", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
         "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
        {"type": "web_search", "external_web_access": False},
    ])
    assert [t["function"]["name"] for t in tools.tools] == ["exec_command", "multi_agent_v1.spawn_agent"]
    assert tools.tools[0]["function"]["strict"] is False
    assert tools.namespaces == {"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")}
    assert tools.not_offered == ["web_search"]
    assert to_chat_tool_choice({"type": "function", "name": "exec_command"}, tools) == \
        {"type": "function", "function": {"name": "exec_command"}}
    assert to_chat_tool_choice("required", tools) == "required"
    for bad in ({"type": "web_search"}, {"type": "function", "name": "nope"}):
        with pytest.raises(APIError) as err:
            to_chat_tool_choice(bad, tools)
        assert err.value.param.startswith("tool_choice")
    # a call of a namespaced tool comes back as name + namespace
    b = OutputBuilder(tools.namespaces)
    b.feed({"tool_calls": [{"index": 0, "id": "c9", "function": {"name": "multi_agent_v1.spawn_agent",
                                                                 "arguments": "{}"}}]})
    b.finish()
    (call,) = b.items
    assert (call["name"], call["namespace"], call["call_id"]) == ("spawn_agent", "multi_agent_v1", "c9")
    assert to_messages(b.items, opener()).messages[0]["tool_calls"][0]["function"]["name"] == \
        "multi_agent_v1.spawn_agent"


def test_stream_events_have_openai_shapes_and_order():
    b = OutputBuilder({})
    events = EventStream()
    deltas = [{"role": "assistant", "content": ""}, {"reasoning": "hm"}, {"content": "Hel"}, {"content": "lo"},
              {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": "}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    raw = [events.encode(k, f) for d in deltas for k, f in b.feed(d)] + [events.encode(k, f) for k, f in b.finish()]
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "in_progress"}
    closing = finish_response(response, b.items, "tool_calls", to_usage(
        {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}}))
    raw.append(events.encode(closing, {"response": response}))
    parsed = []
    for chunk in raw:
        head, data = chunk.decode().strip().split("\n")
        event = EVENT.validate_python(json.loads(data[len("data: "):]))
        assert head == f"event: {event.type}"
        parsed.append(event)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = Response.model_validate(parsed[-1].response.model_dump())
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[1].content[0].text == "Hello" and final.output[2].arguments == '{"a": 1}'
    assert final.usage.input_tokens_details.cached_tokens == 8 and final.usage.total_tokens == 14
    # the same message, not streamed, gives the same items
    whole = OutputBuilder({})
    whole.feed(whole_message_delta({"reasoning": "hm", "content": "Hello", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}))
    whole.finish()
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(whole.items) == strip(b.items)


def test_empty_answer_is_an_empty_message_and_length_is_incomplete():
    b = OutputBuilder({})
    b.feed({"content": None})
    b.finish()
    assert b.items[0]["type"] == "message" and b.items[0]["content"][0]["text"] == ""
    r = {"output": []}
    assert finish_response(r, b.items, "length", None) == "response.incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert finish_response(r, [], None, None, {"code": "server_error", "message": "x"}) == "response.failed"


def test_stored_responses_rebuild_their_chain(log_target):
    """store: true keeps each response's turn; a chain of them is the conversation (forks too)."""
    from agentkv.compaction.log.open import open_session_log

    log = open_session_log(log_target)
    turn = lambda q, a: [{"role": "user", "content": q}, {"role": "assistant", "content": a}]  # noqa: E731
    log.put_response("r1", "o/s", None, turn("q1", "a1"), {"id": "r1"})
    log.put_response("r2", "o/s", "r1", turn("q2", "a2\x00"), {"id": "r2"})
    log.put_response("r3", "o/s", "r1", turn("q3", "a3"), {"id": "r3"})
    assert log.response_conversation("r2") == turn("q1", "a1") + turn("q2", "a2\x00")
    assert log.response_conversation("r3") == turn("q1", "a1") + turn("q3", "a3")
    assert log.get_response("r3") == ("o/s", {"id": "r3"})
    assert log.get_response("nope") is None and log.response_conversation("nope") == []
