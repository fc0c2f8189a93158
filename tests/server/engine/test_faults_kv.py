"""The fault tests of test_faults.py once more with KV reuse on (``--kv-reuse shift``): the engine
killed mid-stream with a session's blocks spilled to the host tier (they die with it: the session's
next clear recomputes, HTTP 200), and the server killed with writers in flight (the log recovers).
The checks are test_faults.py's own."""

from __future__ import annotations

import importlib.util
import time
import uuid
from pathlib import Path

import pytest

from conftest import start_server

# test_faults.py beside this file, loaded as a module of its own (its checks are called below)
_spec = importlib.util.spec_from_file_location("faults_checks", Path(__file__).with_name("test_faults.py"))
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)

SHIFT = ("--model", faults.MODEL, "--kv-reuse", "shift")
# a pool of 72 blocks (128 tokens each; 71 usable) holding at most 3 for sessions: a held prompt of 4+
# blocks is released at once, and spilled to the host tier when a long request takes its blocks
SMALL_POOL = ("--max-model-len", "8192", "--kv-hold-fraction", "0.05", "--engine-arg=--num-gpu-blocks-override=72")


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


def spilled_blocks(server) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.http().get("/metrics").text.splitlines()
               if line.startswith("vllm:agentkv_kv_spilled_blocks_total"))


@pytest.mark.last
def test_engine_killed_mid_stream_with_kv_reuse(tmp_path):
    server = start_server(tmp_path, *SHIFT, *SMALL_POOL)
    try:
        sid = f"held-{uuid.uuid4().hex[:8]}"
        msgs = agent_turns(8)
        first = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "messages": msgs, "max_tokens": 1, "context_management": {"edits": []}})
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] > 3 * 128          # over the hold budget: released
        big = server.http().post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "ok " * 3700}], "max_tokens": 1,
            "context_management": {"edits": []}})
        assert big.status_code == 200, big.text
        tokens = first.json()["usage"]["prompt_tokens"] + big.json()["usage"]["prompt_tokens"]
        assert tokens > 71 * 128                                           # so it took the released blocks
        deadline = time.monotonic() + 30
        while spilled_blocks(server) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert spilled_blocks(server) >= 4                                 # in the host tier of the engine about to die
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
