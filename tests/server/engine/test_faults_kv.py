"""The fault tests of test_faults.py once more with KV reuse on (``--kv-reuse shift``): the engine
killed mid-stream (its held blocks die with it: the session's next clear recomputes, HTTP 200), and
the server killed with writers in flight (the log recovers). The checks are test_faults.py's own."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest

from conftest import start_server

# test_faults.py beside this file, loaded as a module of its own (its checks are called below)
_spec = importlib.util.spec_from_file_location("faults_checks", Path(__file__).with_name("test_faults.py"))
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)

SHIFT = ("--model", faults.MODEL, "--kv-reuse", "shift")


def clearing_turn(server, sid: str, msgs: list[dict]):
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "messages": msgs, "max_tokens": 1, "temperature": 0, "kv_reuse": "shift",
        "context_management": {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}})
    assert r.status_code == 200, r.text
    return r.json()


def agent_turns(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "check"}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
                  "function": {"name": "bash", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": "\n".join(f"line {i}.{j}" for j in range(60))}]
    return msgs


@pytest.mark.last
def test_engine_killed_mid_stream_with_kv_reuse(tmp_path):
    server = start_server(tmp_path, *SHIFT)
    try:
        sid = f"held-{uuid.uuid4().hex[:8]}"
        msgs = agent_turns(3)
        first = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "messages": msgs, "max_tokens": 1, "context_management": {"edits": []}})
        assert first.status_code == 200, first.text                      # held by the engine about to die
        faults.test_engine_killed_mid_stream(server)
        body = clearing_turn(server, sid, msgs + [{"role": "user", "content": "next"}])
        kv = body["context_management"]["applied_edits"][0]["kv"]
        assert kv["fallback"] == "not_held" and kv["reused_tokens"] == 0   # the new engine holds nothing
    finally:
        server.stop()


@pytest.mark.last
def test_server_killed_mid_write_with_kv_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_KV_REUSE", "shift")       # the servers it starts take these
    monkeypatch.setenv("AGENTKV_MODEL", faults.MODEL)
    faults.test_server_killed_mid_write_recovers_the_log(tmp_path)
