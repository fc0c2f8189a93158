"""Today's agent clients, from their captured first requests (tests/clients/captured: Claude Code
2.1.332, Codex 0.171.0, opencode 1.18.33, pi 0.73.1, each run against a capturing server): against
the default server each gets a 200 or the clear "prompt is too long" 400 at once (no summary first,
no retries); against a window that fits, a 200. Then every field and beta Claude Code sends today,
each honoured or ignored on purpose; and compressed request bodies (gzip, deflate, zstd), the limit applying to what
they inflate to."""

from __future__ import annotations

import copy
import gzip
import json
import time
import uuid
import zlib
from pathlib import Path

import pytest
import zstandard

from conftest import REAL

CAPTURED = Path(__file__).resolve().parents[1] / "clients" / "captured"
CLIENTS = sorted(p.stem for p in CAPTURED.glob("*.json"))


def captured(name: str, model: str) -> tuple[str, dict, dict]:
    c = json.loads((CAPTURED / f"{name}.json").read_text())
    return c["path"], {**c["headers"], "x-session-id": f"cap-{uuid.uuid4().hex[:8]}"}, {**c["body"], "model": model}


def send(server, path: str, headers: dict, body: dict) -> tuple[int, str, float]:
    """(status, the first bytes of the answer, seconds to the status): a stream is closed after its first event."""
    t0 = time.monotonic()
    with server.http().stream("POST", path, headers=headers, json=body) as r:
        elapsed = time.monotonic() - t0
        head = next(r.iter_text(), "") if r.status_code == 200 and body.get("stream") else r.read().decode()
        return r.status_code, head, elapsed


@pytest.mark.parametrize("client", CLIENTS)
def test_each_captured_first_request_gets_a_200_or_the_clear_error_at_once(real_server, client):
    path, headers, body = captured(client, REAL)
    status, head, elapsed = send(real_server, path, headers, body)
    assert elapsed < 30, (client, elapsed)   # no summary written first (that took minutes); generous: noisy CPUs
    if status == 400:
        assert "prompt is too long: " in head or "context_length_exceeded" in head, head
        assert "8192" in head and "--max-model-len" in head
    else:
        assert status == 200, (client, head[:500])


@pytest.mark.parametrize("client", CLIENTS)
def test_each_captured_first_request_is_answered_where_the_window_fits(wide_server, client):
    path, headers, body = captured(client, "agentkv-tiny")
    status, head, _ = send(wide_server, path, headers, body)
    assert status == 200, (client, head[:500])


# -- what Claude Code 2.1.332 sends, field by field --------------------------------------------------
def claude_code(model: str = "agentkv-tiny") -> tuple[dict, dict]:
    _, headers, body = captured("claude-code-2.1.332", model)
    return headers, {**body, "stream": False, "max_tokens": 1}


def count(server, body: dict, headers: dict | None = None) -> int:
    keep = {k: v for k, v in body.items() if k in ("model", "system", "messages", "tools", "context_management")}
    r = server.http().post("/v1/messages/count_tokens", headers=headers or {}, json=keep)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_the_captured_request_is_what_claude_code_sends_today():
    headers, body = claude_code()
    assert (body["thinking"] == {"type": "adaptive", "display": "omitted"}
            and body["output_config"] == {"effort": "high"})
    assert json.loads(body["metadata"]["user_id"])["session_id"] == headers["x-claude-code-session-id"]
    assert body["context_management"] == {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert [m["role"] for m in body["messages"]] == ["user", "system"]              # a system message inside
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header")
    assert any(t.get("defer_loading") for t in body["tools"]) and any(t["name"] == "ToolSearch" for t in body["tools"])
    for beta in ("mid-conversation-tool-changes-2026-07-01", "advanced-tool-use-2025-11-20", "effort-2025-11-24",
                 "thinking-token-count-2026-05-13", "context-management-2025-06-27"):
        assert beta in headers["anthropic-beta"]


@pytest.mark.parametrize("field", ["thinking", "output_config", "anthropic-beta", "metadata", "context_management"])
def test_a_field_claude_code_sends_is_accepted_and_used_as_documented(wide_server, field):
    """``thinking`` (adaptive, display) and ``output_config.effort``: accepted, not passed on (the
    served model has no reasoning parser; its template decides); every ``anthropic-beta`` value:
    accepted whatever it is; ``metadata.user_id``: names the session; ``clear_thinking`` with
    ``keep: all``: clears nothing."""
    headers, body = claude_code()
    if field == "metadata":
        headers.pop("x-claude-code-session-id")
        headers.pop("x-session-id")
        body["metadata"] = {"user_id": json.dumps({"device_id": "d", "session_id": str(uuid.uuid4())})}
    r = wide_server.http().post("/v1/messages?beta=true", headers=headers, json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    if field == "metadata":
        assert r.headers["x-session-id"] == json.loads(body["metadata"]["user_id"])["session_id"]
    if field == "context_management":
        assert reply["context_management"]["applied_edits"] == []
    if field == "thinking":
        assert all(b["type"] != "thinking" for b in reply["content"])


def test_billing_header_cache_control_and_a_system_message_inside_are_logged_as_documented(wide_server):
    headers, body = claude_code()
    r = wide_server.http().post("/v1/messages?beta=true", headers=headers, json=body)
    assert r.status_code == 200, r.text
    log = wide_server.http().get(f"/v1/sessions/{r.headers['x-session-id']}/messages").json()["data"]
    assert [m["role"] for m in log] == ["system", "user", "system"]                  # in place
    assert "x-anthropic-billing-header" not in json.dumps(log) and "cache_control" not in json.dumps(log)


def test_deferred_tools_wait_for_a_tool_reference_and_tool_changes_apply_in_order(wide_server):
    """``defer_loading`` tools are not offered until a ``tool_reference`` block in a tool result loads
    them (Claude Code's ToolSearch); ``tool_addition`` / ``tool_removal`` blocks change the offered
    set from where they stand (both betas Claude Code sends)."""
    _, body = claude_code()
    deferred = next(t for t in body["tools"] if t.get("defer_loading"))
    base = count(wide_server, body)
    assert count(wide_server, {**body, "tools": [t for t in body["tools"] if t is not deferred]}) == base
    search = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "ToolSearch",
                                                "input": {"query": deferred["name"]}}]}
    loaded = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s", "content": [
        {"type": "tool_reference", "tool_name": deferred["name"]}]}]}
    after = copy.deepcopy(body)
    after["messages"] += [search, loaded]
    grown = count(wide_server, after)
    without_tool = copy.deepcopy(after)
    without_tool["tools"] = [t for t in after["tools"] if t is not deferred and t["name"] != deferred["name"]]
    assert grown > count(wide_server, without_tool)                      # the deferred tool is offered now
    removal = {"role": "user", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Bash"}},
                                            {"type": "text", "text": "no more shell"}]}
    fewer = copy.deepcopy(body)
    fewer["messages"].append(removal)
    no_bash = copy.deepcopy(body)
    no_bash["messages"].append({"role": "user", "content": [{"type": "text", "text": "no more shell"}]})
    no_bash["tools"] = [t for t in body["tools"] if t["name"] != "Bash"]
    assert count(wide_server, fewer) == count(wide_server, no_bash)
    note = {"type": "text", "text": "tools changed"}               # Claude Code's form: in a system message
    in_system = copy.deepcopy(body)
    in_system["messages"].append({"role": "system", "content": [removal["content"][0], note]})
    system_no_bash = copy.deepcopy(no_bash)
    system_no_bash["messages"][-1] = {"role": "system", "content": [note]}
    assert count(wide_server, in_system) == count(wide_server, system_no_bash)
    top = {"model": body["model"], "system": [removal["content"][0]], "messages": body["messages"]}  # text only
    r = wide_server.http().post("/v1/messages/count_tokens", json=top)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("system.0:"), r.text
    addition = {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
        "name": "Deploy", "description": "deploy the service", "input_schema": {"type": "object"}}}}
    more = copy.deepcopy(body)
    more["messages"].append({"role": "user", "content": [addition, {"type": "text", "text": "ship it"}]})
    r = wide_server.http().post("/v1/messages?beta=true", json={**more, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert count(wide_server, more) > count(wide_server, no_bash)


# -- compressed bodies ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_compressed_request_bodies_are_read_and_bounded(small_server, encoding):
    pack = {"gzip": gzip.compress, "deflate": zlib.compress, "zstd": zstandard.ZstdCompressor().compress}[encoding]
    body = json.dumps({"model": "agentkv-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    http = small_server.http()
    r = http.post("/v1/chat/completions", content=pack(body.encode()),
                  headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 200, r.text
    bomb = pack(b'{"model": "' + b"a" * (33 * 2**20) + b'"}')          # small on the wire, over 32 MiB inflated
    assert len(bomb) < 2**20
    r = http.post("/v1/chat/completions", content=bomb, headers={"content-type": "application/json",
                                                                 "content-encoding": encoding})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    r = http.post("/v1/chat/completions", content=b"not compressed", headers={"content-encoding": encoding})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding", r.text
    r = http.post("/v1/messages", content=pack(b"{}"), headers={"content-encoding": "br"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", r.text
