"""KV reuse through the real engine: the connector shifts cached K/V after clearing.

With the 1-layer embedded model, `shift` must give the next-token logprobs of `recompute`
(layer-0 K/V are position-shift exact), and must really reuse (more cached tokens)."""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import start_server

from agentkv.server.embedded_model import TinyModelSpec, build_model

CLEAR = {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}
NONE = {"edits": []}


@pytest.fixture(scope="module")
def shift_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("kv-home")
    model = build_model(home / "tiny-1l", TinyModelSpec(layers=1))
    srv = start_server(home, "--model", str(model), "--served-model-name", "agentkv-tiny",
                       "--kv-reuse", "shift", "--max-model-len", "8192")
    yield srv
    srv.stop()


def conversation() -> list[dict]:
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    for i, svc in enumerate(("media", "auth", "billing")):
        out = "\n".join(f"{svc} probe {j}: latency {j * 7 % 300} ms ok" for j in range(70))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"cmd": f"diag {svc}"})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": out}]
    return msgs


def ask(server, msgs, sid, cm, mode, **extra):
    # each run gets its own cache salt: the reference must not hit blocks the shifted run cached
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "agentkv-tiny", "messages": msgs, "max_tokens": 1, "temperature": 0, "logprobs": True,
        "top_logprobs": 5, "context_management": cm, "kv_reuse": mode, "cache_salt": sid, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def top(body) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_shift_equals_recompute_at_layer0_and_reuses(shift_server):
    msgs = conversation()
    later = msgs + [{"role": "user", "content": "which service is slow?"}]
    sid = f"k-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "shift")                       # saved: the source prompt
    shifted = ask(shift_server, later, sid, CLEAR, "shift")
    edit = shifted["context_management"]["applied_edits"][0]
    assert edit["kv"]["mode"] == "shift" and edit["kv"]["planned_reuse_tokens"] > 500

    ref_sid = f"r-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, ref_sid, NONE, "recompute")
    recomputed = ask(shift_server, later, ref_sid, CLEAR, "recompute")
    assert shifted["usage"]["prompt_tokens"] == recomputed["usage"]["prompt_tokens"]
    a, b = top(shifted), top(recomputed)
    assert list(a)[0] == list(b)[0]                                     # same top-1
    for tok in set(a) & set(b):
        assert abs(a[tok] - b[tok]) < 2e-3, (tok, a[tok], b[tok])
    cached_shift = shifted["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached_ref = recomputed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_shift >= cached_ref + 256, (cached_shift, cached_ref)
    metrics = shift_server.http().get("/metrics").text
    assert 'agentkv_kv_planned_reuse_tokens_total{mode="shift"}' in metrics
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0          # tokens the connector supplied


def external_hits(server) -> float:
    """Tokens the connector supplied so far (vLLM's counter)."""
    text = server.http().get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def test_with_server_tools_the_context_step_sees_the_engines_prompt(shift_server):
    """Server tools are added before the context step: it counts the prompt the engine gets and
    hashes the same token ids, so the connector's load checks out instead of falling back."""
    msgs = conversation()
    later = msgs + [{"role": "user", "content": "which service is slow?"}]
    sid = f"t-{uuid.uuid4().hex[:8]}"
    first = ask(shift_server, msgs, sid, NONE, "shift", server_tools=True)
    assert first["context_management"]["prompt_tokens_before"] == first["usage"]["prompt_tokens"]
    hits = external_hits(shift_server)
    shifted = ask(shift_server, later, sid, CLEAR, "shift", server_tools=True)
    cm = shifted["context_management"]
    (edit,) = cm["applied_edits"]
    assert cm["prompt_tokens_after"] == shifted["usage"]["prompt_tokens"]
    assert cm["prompt_tokens_before"] - cm["prompt_tokens_after"] == edit["cleared_input_tokens"]
    planned = edit["kv"]["planned_reuse_tokens"]
    assert planned > 500
    supplied = external_hits(shift_server) - hits
    assert supplied >= planned, (supplied, planned)                     # the load was not refused


def test_recompute_only_server_refuses_shift_requests(server):
    r = server.http().post("/v1/chat/completions", json={
        "model": "agentkv-tiny", "messages": [{"role": "user", "content": "x"}], "kv_reuse": "shift"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_reuse"
