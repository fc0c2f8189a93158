"""Server-side context management through the real server: sessions, per-request policies, the
applied-edits report, server-executed recall/note, key isolation, and bad input."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from agentkv.compaction.config import Compact
from agentkv.compaction.log.open import open_session_log
from agentkv.compaction.summarize import changed_files, previous_note, summarize, summary_message, user_messages
from agentkv.server.pipeline.sessions import ViewState

from conftest import API_KEY, OTHER_KEY

MODEL = "agentkv-tiny"
FACT = "timeout_ms = 1050"


def diag_conversation(services=("media", "auth", "billing", "search")) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Run diagnostics."}]
    for i, svc in enumerate(services):
        lines = [f"{svc} check {j}: ok latency {j * 3} ms" for j in range(60)]
        lines.insert(20, FACT if svc == "media" else f"port = {8000 + i}")
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{i}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"cmd": f"python diag.py {svc}"})}}]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": "\n".join(lines)}]
    return msgs + [{"role": "user", "content": "Which services look slow?"}]


def chat(server, messages, session, key=API_KEY, **extra):
    return server.http(api_key=key).post("/v1/chat/completions", headers={"X-Session-Id": session},
                                         json={"model": MODEL, "messages": messages, "max_tokens": 4,
                                               "temperature": 0, **extra})


CLEAR = {"edits": [{"type": "clear_tool_uses", "trigger": {"type": "input_tokens", "value": 500},
                    "keep": {"type": "tool_uses", "value": 1}}]}


def test_clearing_fires_at_trigger_and_the_engine_sees_the_cleared_prompt(server):
    sid = f"t-{uuid.uuid4().hex[:8]}"
    r = chat(server, diag_conversation(), sid, context_management=CLEAR)
    assert r.status_code == 200, r.text
    body = r.json()
    cm = body["context_management"]
    assert cm["session_id"] == sid and r.headers["x-session-id"] == sid
    (edit,) = cm["applied_edits"]
    assert edit["type"] == "clear_tool_uses" and edit["cleared_tool_uses"] == 3
    assert cm["prompt_tokens_before"] - cm["prompt_tokens_after"] == edit["cleared_input_tokens"] > 1000
    assert len(edit["edits"]) == 3
    assert body["usage"]["prompt_tokens"] == cm["prompt_tokens_after"]     # what vLLM really got

    below = {"edits": [{"type": "clear_tool_uses", "trigger": 10**6}]}
    r2 = chat(server, diag_conversation(), f"u-{sid}", context_management=below)
    cm2 = r2.json()["context_management"]
    assert cm2["applied_edits"] == [] and r2.json()["usage"]["prompt_tokens"] == cm2["prompt_tokens_before"]


def test_the_chat_route_takes_anthropics_names(server):
    sid = f"o-{uuid.uuid4().hex[:8]}"
    cm = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                    {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
                     "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["bash"]}]}
    r = chat(server, diag_conversation(), sid, context_management=cm)
    assert r.status_code == 200, r.text
    (edit,) = r.json()["context_management"]["applied_edits"]
    assert edit["type"] == "clear_tool_uses_20250919" and edit["cleared_tool_uses"] == 3
    assert {e["kind"] for e in edit["edits"]} == {"clear_tool_result", "clear_tool_input"}


def test_view_is_stable_next_turn_hits_the_prefix_cache_and_log_keeps_originals(server):
    sid = f"s-{uuid.uuid4().hex[:8]}"
    msgs = diag_conversation()
    first = chat(server, msgs, sid, context_management=CLEAR).json()
    msgs2 = msgs + [{"role": "assistant", "content": "media and search."}, {"role": "user", "content": "Why?"}]
    second = chat(server, msgs2, sid, context_management=CLEAR).json()
    assert second["context_management"]["applied_edits"] == []          # nothing new to clear
    assert second["context_management"]["prompt_tokens_after"] > first["context_management"]["prompt_tokens_after"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * first["usage"]["prompt_tokens"]
    owner = hashlib.sha256(API_KEY.encode()).hexdigest()[:16]
    history = open_session_log(server.home / "sessions.db").history(f"{owner}/{sid}")
    assert history == msgs2                                               # every original, in order
    assert FACT in history[3]["content"]


RECALL_CALL = r'<tool_call>\{"name": "recall", "arguments": \{"query": "media timeout"\}\}</tool_call>'
# a regex constrains characters, not tokens: greedy, and room for the call however it is spelled
CALL_ROOM = {"max_tokens": 160, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_server_executed_recall_finds_a_cleared_fact(server, stream):
    sid = f"r-{uuid.uuid4().hex[:8]}"
    extra = dict(context_management=CLEAR, server_tools=True, structured_outputs={"regex": RECALL_CALL}, **CALL_ROOM)
    if not stream:
        body = chat(server, diag_conversation(), sid, **extra).json()
        calls, final = body["server_tool_calls"], body
        assert not final["choices"][0]["message"].get("tool_calls")
    else:
        r = chat(server, diag_conversation(), sid, stream=True, stream_options={"include_usage": True}, **extra)
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
        assert r.text.rstrip().endswith("data: [DONE]")
        final = events[-1]
        calls = final["server_tool_calls"]
        assert not any(e["choices"] and e["choices"][0]["delta"].get("tool_calls") for e in events)
    assert calls[0]["name"] == "recall" and FACT in calls[0]["result"]
    assert final["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 3


def test_note_tool_is_stored(server):
    sid = f"n-{uuid.uuid4().hex[:8]}"
    regex = r'<tool_call>\{"name": "note", "arguments": \{"kind": "decision", "text": "use port 8443"\}\}</tool_call>'
    body = chat(server, [{"role": "user", "content": "decide"}], sid, server_tools=True,
                structured_outputs={"regex": regex}, max_tokens=150).json()
    assert body["server_tool_calls"][0]["result"] == "noted"
    owner = hashlib.sha256(API_KEY.encode()).hexdigest()[:16]
    assert open_session_log(server.home / "sessions.db").notes(f"{owner}/{sid}") == [("decision", "use port 8443")]


def test_two_api_keys_cannot_see_each_others_sessions(server):
    sid = f"shared-{uuid.uuid4().hex[:8]}"
    assert chat(server, diag_conversation(), sid, key=API_KEY).status_code == 200
    r = chat(server, [{"role": "user", "content": "recall it"}], sid, key=OTHER_KEY, server_tools=True,
             structured_outputs={"regex": RECALL_CALL}, **CALL_ROOM)
    result = r.json()["server_tool_calls"][0]["result"]
    assert result == "No match in the session log." and FACT not in r.text


@pytest.mark.parametrize("cm, param", [
    ({"edits": [{"type": "delete_everything"}]}, "context_management.edits.0.type"),
    ({"edits": [{"trigger": 5}]}, "context_management.edits.0.type"),
    ({"edits": [{"type": "compact_20260112", "trigger": 1000}]}, "context_management.edits.0.compact_20260112"),
    ({"edits": [{"type": "compact"}, {"type": "clear_thinking_20251015"}]}, "context_management.edits"),
    ({"edits": [{"type": "clear_tool_uses", "trigger": -5}]},
     "context_management.edits.0.clear_tool_uses.trigger.value"),
    ({"edits": [{"type": "compact", "keep_recent_tokens": -1}]},
     "context_management.edits.0.compact.keep_recent_tokens"),
    ({"edits": [{"type": "clear_tool_uses", "bogus": 1}]}, "context_management.edits.0.clear_tool_uses.bogus"),
    ({"edits": "all"}, "context_management.edits"),
])
def test_bad_context_management_is_a_400_naming_the_field(server, cm, param):
    r = chat(server, [{"role": "user", "content": "x"}], "bad", context_management=cm)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_session_ids_and_reserved_tool_names(server):
    r = chat(server, [{"role": "user", "content": "x"}], "../../etc/passwd")
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    tools = [{"type": "function", "function": {"name": "recall", "parameters": {"type": "object"}}}]
    r = chat(server, [{"role": "user", "content": "x"}], "ok", server_tools=True, tools=tools)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_oversized_request_is_413_and_the_server_keeps_serving(server):
    huge = "x" * (33 * 2**20)
    r = server.http().post("/v1/chat/completions", content=json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": huge}]}),
        headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = server.http().post("/v1/messages", content=json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": huge}]}),
        headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json() == {"type": "error", "error": {
        "type": "request_too_large", "message": f"request body exceeds {32 * 2**20} bytes"}}   # Anthropic's shape
    assert chat(server, [{"role": "user", "content": "still there?"}], "alive").status_code == 200


def test_oversized_chunked_request_is_413_too(server):
    """Without Content-Length (a generator body goes out chunked) the limit still answers 413."""
    def chunked(body: bytes):
        for i in range(0, len(body), 2**20):
            yield body[i:i + 2**20]

    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (33 * 2**20)}]}).encode()
    r = server.http().post("/v1/chat/completions", content=chunked(huge), headers={"Content-Type": "application/json"})
    assert r.request.headers["transfer-encoding"] == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                        "temperature": 0}).encode()
    r = server.http().post("/v1/chat/completions", content=chunked(small), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_compact_edit_through_the_server(server, renderer):
    """The summary is written by the served model (the engine the server runs) and the engine gets
    the compacted prompt; what was cut is what the library cuts."""
    sid = f"c-{uuid.uuid4().hex[:8]}"
    msgs = diag_conversation()
    edit = {"type": "compact", "trigger": 0, "keep_recent_tokens": 300, "summary_max_tokens": 16}
    r = chat(server, msgs, sid, context_management={"edits": [edit]})
    assert r.status_code == 200, r.text
    body = r.json()
    cm = body["context_management"]
    assert "failed_edits" not in cm, cm["failed_edits"]
    expected = summarize(msgs, renderer, Compact(**edit), _Recording(), history=msgs)
    (applied,) = cm["applied_edits"]
    assert applied["type"] == "compact"
    assert applied["summarized_messages"] == expected.summarized_messages
    kept = msgs[1 + expected.summarized_messages:]
    assert kept and kept[0]["role"] != "tool"
    owner = hashlib.sha256(API_KEY.encode()).hexdigest()[:16]
    state = ViewState.load(open_session_log(server.home / "sessions.db").get_state(f"{owner}/{sid}"))
    assert applied["summary_tokens"] == renderer.count_text(state.summary["content"])
    note = previous_note([state.summary])                     # the model's note, the rest copied by code
    assert state.summary == summary_message(note, user_messages(msgs, renderer, Compact().user_messages_tokens),
                                            [], changed_files(msgs))
    assert cm["prompt_tokens_before"] == renderer.count(msgs)
    assert body["usage"]["prompt_tokens"] == cm["prompt_tokens_after"] == \
        renderer.count([msgs[0], state.summary] + kept)                      # what vLLM really got
    view = server.http().get(f"/v1/sessions/{sid}").json()["view"]
    assert view == {"cleared": 0, "summarized": expected.summarized_messages}


class _Recording:
    def complete(self, messages, max_tokens):
        return "note"


def test_session_id_is_derived_when_absent(server):
    msgs = [{"role": "system", "content": f"sys {uuid.uuid4()}"}, {"role": "user", "content": "hello"}]
    r1 = server.http().post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2})
    msgs += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    r2 = server.http().post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2})
    assert r1.headers["x-session-id"].startswith("auto-")
    assert r1.headers["x-session-id"] == r2.headers["x-session-id"]


def test_the_default_policy_clears_in_one_batch_that_lasts(server):
    """Once the prompt fills 80% of the room (the window less the system prompt and tools: tiny
    here), old tool results are cleared in one batch down to about 20% of it, the newest result
    kept; the next turns add results without clearing again (the old default, at half the window
    in batches of a tenth, cleared again on most turns)."""
    window = server.http().get("/v1/models").json()["data"][0]["max_model_len"]
    services = [f"svc{i}" for i in range(26)]
    msgs = diag_conversation(services)
    sid = f"d-{uuid.uuid4().hex[:8]}"
    cm = chat(server, msgs, sid).json()["context_management"]
    assert cm["prompt_tokens_before"] >= 0.78 * window
    (edit,) = cm["applied_edits"]
    assert edit["type"] == "clear_tool_uses" and edit["cleared_tool_uses"] >= len(services) - 3
    assert cm["prompt_tokens_after"] <= 0.3 * window
    after = cm["prompt_tokens_after"]
    for i in range(3):                   # three more tool turns: the batch bought them
        msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"more_{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": f"more_{i}",
                        "content": "\n".join(f"more {i} check {j}: ok" for j in range(60))}]
        r = chat(server, msgs, sid)
        assert r.status_code == 200, r.text
        cm = r.json()["context_management"]
        assert cm["applied_edits"] == [] and cm["prompt_tokens_after"] > after
        after = cm["prompt_tokens_after"]


def test_a_system_prompt_that_leaves_little_room_is_said_in_a_header(server):
    """System prompt and tools over three quarters of the window: clearing can keep few turns, and
    the response says so (``X-Context-Room``, and once in the log) instead of the policy thrashing
    silently; a small one gets no header."""
    window = server.http().get("/v1/models").json()["data"][0]["max_model_len"]
    probe = chat(server, [{"role": "system", "content": "alpha beta " * 200}, {"role": "user", "content": "hi"}],
                 f"p-{uuid.uuid4().hex[:8]}")
    assert probe.status_code == 200 and "x-context-room" not in probe.headers
    per_pair = probe.json()["usage"]["prompt_tokens"] / 200
    big = "alpha beta " * int(0.85 * window / per_pair)
    r = chat(server, [{"role": "system", "content": big}, {"role": "user", "content": "hi"}],
             f"q-{uuid.uuid4().hex[:8]}")
    assert r.status_code == 200, r.text
    room = r.headers["x-context-room"]
    assert f"of the {window}-token window" in room and "tokens are left for the conversation" in room
