"""Anthropic Messages API on the same engine and context management."""

from __future__ import annotations

import json
import uuid

import anthropic
import pytest
from agent_sessions import conversations
from conftest import API_KEY
from hypothesis import given, settings

from agentkv.server.anthropic_format import to_anthropic, to_openai


def _merged_turns(msgs: list[dict]) -> list[dict]:
    """Anthropic has one turn where OpenAI may have several user (or assistant) messages in a row:
    their texts join, and an assistant turn's tool calls are concatenated."""
    out: list[dict] = []
    for m in msgs:
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + m["content"]}
        elif out and m["role"] == "assistant" and out[-1]["role"] == "assistant":
            prev = out[-1]
            merged = {"role": "assistant", "content": ((prev["content"] or "") + (m["content"] or "")) or None}
            calls = (prev.get("tool_calls") or []) + (m.get("tool_calls") or [])
            if calls:
                merged["tool_calls"] = calls
            out[-1] = merged
        else:
            out.append(dict(m))
    return out


@settings(max_examples=60, deadline=None)
@given(msgs=conversations())
def test_openai_anthropic_round_trip(msgs):
    system, messages = to_anthropic(msgs)
    assert all(a["role"] != b["role"] for a, b in zip(messages, messages[1:]))   # turns alternate
    assert to_openai(system, messages) == _merged_turns(msgs)


def diag() -> list[dict]:
    out = "\n".join(f"media check {j}: ok" for j in range(80)) + "\ntimeout_ms = 1050"
    return [{"role": "user", "content": "check media"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "bash", "input": {"cmd": "diag"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": out}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu2", "name": "bash", "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu2", "content": "a.py"},
                                         {"type": "text", "text": "what is slow?"}]}]


CLEAR = {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}
TOOLS = [{"name": "bash", "description": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def test_messages_with_the_anthropic_client(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    msg = client.messages.create(model="agentkv-tiny", max_tokens=8, system="You are an agent.",
                                 messages=diag(), tools=TOOLS)
    assert msg.role == "assistant" and msg.usage.input_tokens > 50 and msg.content
    with client.messages.stream(model="agentkv-tiny", max_tokens=8, messages=diag(), tools=TOOLS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1 and isinstance(text, str)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_context_management_clears_and_reports(server, stream):
    sid = f"a-{uuid.uuid4().hex[:8]}"
    body = {"model": "agentkv-tiny", "max_tokens": 4, "messages": diag(), "tools": TOOLS,
            "context_management": CLEAR, "stream": stream}
    r = server.http().post("/v1/messages", headers={"X-Session-Id": sid}, json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        cm = next(e["context_management"] for e in events if e.get("type") == "message_delta")
    else:
        cm = r.json()["context_management"]
    (edit,) = cm["applied_edits"]
    assert edit["cleared_tool_uses"] == 1 and cm["prompt_tokens_after"] < cm["prompt_tokens_before"]


def test_messages_bad_input_gets_anthropic_error(server):
    r = server.http().post("/v1/messages", json={"model": "agentkv-tiny", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = server.http().post("/v1/messages", json={"model": "agentkv-tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
