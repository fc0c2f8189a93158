"""KV reuse through the real engine: the connector moves held K/V after clearing.

With the 1-layer embedded model, ``shift`` must give the next-token logprobs of ``recompute``
(layer-0 K/V are position-shift exact) while really reusing (more cached tokens), with prompts
prefilled in chunks (a step budget of 512 tokens, prompts of ~1,700). Every way reuse can fail
falls back to recompute: HTTP 200, recompute's logprobs, the reason in the edit's report and in
the engine's counters. Held blocks the pool takes back come back from the host tier."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from agentkv.server.embedded_model import TinyModelSpec, build_model

from conftest import start_server

CLEAR = {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}
NONE = {"edits": []}
STEP_TOKENS = 512
POOL_BLOCKS = 80          # 128-token blocks: the 8k window plus a little, so one request can need the held ones
OFFLOAD_GIB = "0.004"     # the host tier: 64 blocks of this model's 64 KiB (1 layer, 2 heads x 32, float32)


def tiny_1l(home: Path) -> Path:
    return build_model(home / "tiny-1l", TinyModelSpec(layers=1))


@pytest.fixture(scope="module")
def shift_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("kv-home")
    srv = start_server(home, "--model", str(tiny_1l(home)), "--served-model-name", "agentkv-tiny",
                       "--kv-reuse", "shift", "--max-model-len", "8192", "--kv-hold-fraction", "0.4",
                       "--kv-offload-gib", OFFLOAD_GIB,
                       f"--engine-arg=--max-num-batched-tokens={STEP_TOKENS}",
                       f"--engine-arg=--num-gpu-blocks-override={POOL_BLOCKS}")
    yield srv
    srv.stop()


def conversation(system: str = "agent", lines: int = 70) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "run the checks"}]
    for i, svc in enumerate(("media", "auth", "billing")):
        out = "\n".join(f"{svc} probe {j}: latency {j * 7 % 300} ms ok" for j in range(lines))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"cmd": f"diag {svc}"})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": out}]
    return msgs


LATER = [{"role": "user", "content": "which service is slow?"}]


def ask(server, msgs, sid, cm, mode, **extra):
    # each run gets its own cache salt: the reference must not hit blocks the shifted run cached
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "agentkv-tiny", "messages": msgs, "max_tokens": 1, "temperature": 0, "logprobs": True,
        "top_logprobs": 5, "context_management": cm, "kv_reuse": mode, "cache_salt": sid, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def top(body) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def same_logprobs(a: dict, b: dict, tol: float = 2e-3) -> None:
    a, b = top(a), top(b)
    assert list(a)[0] == list(b)[0]                                    # same top-1
    assert set(a) & set(b)
    for tok in set(a) & set(b):
        assert abs(a[tok] - b[tok]) < tol, (tok, a[tok], b[tok])


def recomputed(server, msgs, later) -> dict:
    sid = f"r-{uuid.uuid4().hex[:8]}"
    ask(server, msgs, sid, NONE, "recompute")
    return ask(server, later, sid, CLEAR, "recompute")


def kv_report(body) -> dict:
    return body["context_management"]["applied_edits"][0]["kv"]


def cached(body) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server, name: str, **labels) -> float:
    total = 0.0
    for line in server.http().get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(server, name: str, at_least: float, **labels) -> float:
    """vLLM records the engine's counters as it processes outputs: wait a moment for them."""
    deadline = time.monotonic() + 30
    while (value := metric(server, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_shift_equals_recompute_at_layer0_and_reuses_with_chunked_prefill(shift_server):
    msgs = conversation()
    later = msgs + LATER
    sid = f"k-{uuid.uuid4().hex[:8]}"
    first = ask(shift_server, msgs, sid, NONE, "shift")                 # held: the source prompt
    assert first["usage"]["prompt_tokens"] > 3 * STEP_TOKENS            # prefilled in several steps
    shifted = ask(shift_server, later, sid, CLEAR, "shift")
    kv = kv_report(shifted)
    assert kv["mode"] == "shift" and kv["fallback"] is None and kv["reused_tokens"] >= 768, kv
    assert kv["primed_tokens"] > 0
    reference = recomputed(shift_server, msgs, later)
    assert shifted["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    same_logprobs(shifted, reference)
    assert cached(shifted) >= cached(reference) + kv["reused_tokens"]
    assert wait_metric(shift_server, "vllm:agentkv_kv_reused_tokens_total", kv["reused_tokens"]) >= kv["reused_tokens"]
    assert metric(shift_server, "agentkv_kv_edits_total", mode="shift") >= 1
    assert metric(shift_server, "vllm:external_prefix_cache_hits_total") >= kv["reused_tokens"]


def test_blend_leaves_a_tail_to_recompute(shift_server):
    msgs = conversation()
    sid = f"b-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "blend")
    blended = ask(shift_server, msgs + LATER, sid, CLEAR, "blend")
    kv = kv_report(blended)
    assert kv["mode"] == "blend" and kv["fallback"] is None and kv["reused_tokens"] > 0
    sid2 = f"s-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid2, NONE, "shift")
    assert kv["reused_tokens"] < kv_report(ask(shift_server, msgs + LATER, sid2, CLEAR, "shift"))["reused_tokens"]
    same_logprobs(blended, recomputed(shift_server, msgs, msgs + LATER))


def test_with_server_tools_the_context_step_sees_the_engines_prompt(shift_server):
    """Server tools are added before the context step: it counts the prompt the engine gets, and the
    edit's spans are on the engine's prompt, so the connector reuses instead of falling back."""
    msgs = conversation()
    sid = f"t-{uuid.uuid4().hex[:8]}"
    first = ask(shift_server, msgs, sid, NONE, "shift", server_tools=True)
    assert first["context_management"]["prompt_tokens_before"] == first["usage"]["prompt_tokens"]
    shifted = ask(shift_server, msgs + LATER, sid, CLEAR, "shift", server_tools=True)
    cm = shifted["context_management"]
    (edit,) = cm["applied_edits"]
    assert cm["prompt_tokens_after"] == shifted["usage"]["prompt_tokens"]
    assert cm["prompt_tokens_before"] - cm["prompt_tokens_after"] == edit["cleared_input_tokens"]
    assert edit["kv"]["fallback"] is None and edit["kv"]["reused_tokens"] >= 512, edit["kv"]


def test_responses_api_sends_the_edit_and_reports_the_outcome(shift_server):
    """/v1/responses takes the chat path's KV step: the edit reaches the connector, which reuses."""
    items = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    for i, svc in enumerate(("media", "auth", "billing")):
        out = "\n".join(f"{svc} probe {j}: latency {j * 7 % 300} ms ok" for j in range(70))
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "bash", "arguments": json.dumps({"cmd": svc})},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": out}]
    sid = f"resp-{uuid.uuid4().hex[:8]}"

    def respond(inp, cm):
        r = shift_server.http().post("/v1/responses", headers={"X-Session-Id": sid}, json={
            "model": "agentkv-tiny", "input": inp, "max_output_tokens": 1, "temperature": 0, "store": False,
            "context_management": cm, "kv_reuse": "shift"})
        assert r.status_code == 200, r.text
        return r.json()

    respond(items, NONE)
    body = respond(items + [{"role": "user", "content": "which service is slow?"}], CLEAR)
    kv = body["context_management"]["applied_edits"][0]["kv"]
    assert kv["mode"] == "shift" and kv["fallback"] is None and kv["reused_tokens"] >= 512, kv
    assert "kv_transfer_params" not in body


def fallback(server, reason: str, first: list[dict] | None, later: list[dict], sid: str | None = None,
             between=None) -> dict:
    """Clear after ``first`` (None: clearing on the session's first request); the edit must fall back
    to recompute for ``reason`` with recompute's logprobs."""
    sid = sid or f"f-{uuid.uuid4().hex[:8]}"
    before = metric(server, "vllm:agentkv_kv_fallbacks_total", reason=reason)
    held = ask(server, first, sid, NONE, "shift") if first is not None else None
    if between is not None:
        between(held)
    body = ask(server, later, sid, CLEAR, "shift")
    assert kv_report(body)["fallback"] == reason and kv_report(body)["reused_tokens"] == 0, kv_report(body)
    same_logprobs(body, recomputed(server, first or later[:-1], later))
    assert wait_metric(server, "vllm:agentkv_kv_fallbacks_total", before + 1, reason=reason) == before + 1
    return body


def test_nothing_held_for_a_new_session(shift_server):
    fallback(shift_server, "not_held", None, conversation() + LATER)


def test_another_conversation_under_the_same_id_is_a_branch_with_nothing_held(shift_server):
    # the same session id, another conversation: a branch of its own, which holds nothing yet
    fallback(shift_server, "not_held", conversation("agent, v1"), conversation("other agent, v2") + LATER)


def refused_by_the_engine(server, msgs, sid) -> None:
    """A turn the front sends on and vLLM refuses (a token id out of the vocabulary): the branch's
    last prompt is now this one, which the connector never saw, let alone held."""
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "agentkv-tiny", "messages": msgs, "max_tokens": 1, "cache_salt": sid, "logit_bias": {"99999": 1},
        "context_management": NONE, "kv_reuse": "shift"})
    assert r.status_code == 400 and "logit_bias" in r.text, r.text


def test_a_held_prompt_that_is_not_the_last_one_sent_supplies_only_the_prefix_they_share(shift_server):
    """The branch's last prompt went to the engine without the connector holding it (vLLM refused
    its request): the prompt still held is an older one, and the edit, computed against the last
    one, is refused (on c095b51 it was planned against the older one). The fallback still reads
    what recompute would have read: the tokens the older prompt shares with this one from the start,
    at their own positions (the request's approximate salt has none of them cached yet, issue 39:
    a fallback recomputed the whole prompt, more than recompute)."""
    msgs = conversation("agent. " + "Check every service and report what is slow. " * 30)   # > 1 block before the edit
    sid = f"h-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "shift")                                   # held
    refused_by_the_engine(shift_server, msgs + [{"role": "user", "content": "and the logs?"}], sid)   # not held
    later = msgs + [{"role": "user", "content": "and the logs?"}] + LATER
    body = ask(shift_server, later, sid, CLEAR, "shift")
    report = kv_report(body)
    assert report["fallback"] == "held_mismatch" and report["reused_tokens"] >= 128, report
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= report["reused_tokens"]
    same_logprobs(body, recomputed(shift_server, later[:-1], later))


def test_a_recompute_turn_is_held_too_and_the_next_shift_edit_moves_its_kv(shift_server):
    """With retention every turn is held, a ``recompute`` one included (exact K/V): a ``shift``
    edit after it moves the K/V of that prompt, the last one sent."""
    msgs = conversation()
    sid = f"rh-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "shift")
    middle = msgs + [{"role": "user", "content": "and the logs?"}]
    ask(shift_server, middle, sid, NONE, "recompute")                             # held (exact)
    later = middle + LATER
    body = ask(shift_server, later, sid, CLEAR, "shift")
    report = kv_report(body)
    assert report["fallback"] is None and report["reused_tokens"] >= 512, report
    same_logprobs(body, recomputed(shift_server, middle, later))


def fill_the_pool(server, held: dict) -> None:
    """A request of no session (``/v1/completions``) that needs more blocks than are free: the held
    ones go to it. It is not held itself: held, it would be spilled too, and fill the small host tier."""
    r = server.http().post("/v1/completions", json={
        "model": "agentkv-tiny", "prompt": "ok " * 3900, "max_tokens": 1, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    blocks = -(-held["usage"]["prompt_tokens"] // 128)
    assert r.json()["usage"]["prompt_tokens"] > (POOL_BLOCKS - 1 - blocks) * 128   # more than the free blocks


def test_held_blocks_the_pool_takes_back_are_restored_from_the_host_tier(shift_server):
    """The pool hands the held blocks to another request: they were spilled to the host tier on the
    way, and the session's next clear moves them back (recompute's logprobs), counted."""
    names = ("spilled_blocks", "restored_blocks", "restores", "restore_bytes")
    before = {n: metric(shift_server, f"vllm:agentkv_kv_{n}_total") for n in names}
    msgs, later = conversation(), conversation() + LATER
    sid = f"t-{uuid.uuid4().hex[:8]}"
    held = ask(shift_server, msgs, sid, NONE, "shift")
    fill_the_pool(shift_server, held)
    body = ask(shift_server, later, sid, CLEAR, "shift")
    report = kv_report(body)
    assert report["fallback"] is None and report["reused_tokens"] >= 128, report
    same_logprobs(body, recomputed(shift_server, msgs, later))
    blocks = -(-held["usage"]["prompt_tokens"] // 128)
    assert wait_metric(shift_server, "vllm:agentkv_kv_spilled_blocks_total", before["spilled_blocks"] + blocks) \
        >= before["spilled_blocks"] + blocks
    assert wait_metric(shift_server, "vllm:agentkv_kv_restores_total", before["restores"] + 1) >= before["restores"] + 1
    restored = metric(shift_server, "vllm:agentkv_kv_restored_blocks_total") - before["restored_blocks"]
    assert 1 <= restored <= blocks
    assert metric(shift_server, "vllm:agentkv_kv_restore_bytes_total") > before["restore_bytes"]


def test_streamed_shift_is_reused_and_counted(shift_server):
    msgs = conversation(lines=40)
    sid = f"st-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "shift")
    before = metric(shift_server, "vllm:agentkv_kv_reused_tokens_total")
    with shift_server.http().stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "model": "agentkv-tiny", "messages": msgs + LATER, "max_tokens": 3, "stream": True, "cache_salt": sid,
            "stream_options": {"include_usage": True}, "context_management": CLEAR, "kv_reuse": "shift"}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert not any("error" in c for c in chunks)
    report = next(c["context_management"] for c in chunks if c.get("context_management"))
    assert report["applied_edits"][0]["kv"]["mode"] == "shift"
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert wait_metric(shift_server, "vllm:agentkv_kv_reused_tokens_total", before + 128) >= before + 128
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 128


def test_a_server_without_the_connector_falls_back_with_a_log_line(no_connector_server):
    server = no_connector_server
    msgs = conversation(lines=10)
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": f"d-{uuid.uuid4().hex[:8]}"}, json={
        "messages": msgs + LATER, "max_tokens": 1, "context_management": CLEAR, "kv_reuse": "shift"})
    assert r.status_code == 200, r.text
    assert kv_report(r.json()) == {"mode": "recompute", "requested": "shift", "fallback": "connector_disabled"}
    assert metric(server, "agentkv_kv_fallbacks_total", reason="connector_disabled") >= 1
    assert "without the KV connector" in server.log_tail(400)


# -- servers where reuse cannot work at all: each starts once, runs one clear, and stops ------
def _dynamic_rope(home: Path) -> Path:
    model = tiny_1l(home)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


SPECIAL = {
    "no_budget": (lambda home: tiny_1l(home), ["--kv-hold-fraction", "0"], {}),
    "load_failed": (lambda home: tiny_1l(home), [], {"AGENTKV_FAULT_KV_LOAD": "1"}),
    "unsupported": (_dynamic_rope, [], {}),
}


@pytest.mark.parametrize("reason", sorted(SPECIAL))
def test_reuse_impossible_falls_back(tmp_path, reason):
    make_model, flags, env = SPECIAL[reason]
    srv = start_server(tmp_path, "--model", str(make_model(tmp_path)), "--served-model-name", "agentkv-tiny",
                       "--kv-reuse", "shift", "--max-model-len", "4096", *flags, env=env)
    try:
        msgs = conversation(lines=40)
        fallback(srv, reason, msgs, msgs + LATER)
        log = srv.log_tail(2000)
        expected = {"no_budget": "held-block budget is zero", "load_failed": "vLLM recomputes it",
                    "unsupported": "shifting disabled"}[reason]
        assert expected in log
    finally:
        srv.stop()


@pytest.mark.parametrize("strategy", ["tail", "cuts", "deviation"])
def test_blend_strategies_recompute_whole_blocks_with_passes(shift_server, strategy):
    """Each strategy recomputes its share of the moved blocks (a range in the middle through a
    pass, whose blocks the request then hits) and still gives recompute's logprobs."""
    msgs = conversation()
    sid = f"bs-{uuid.uuid4().hex[:8]}"
    blend = {"strategy": strategy, "fraction": 0.3}
    ask(shift_server, msgs, sid, NONE, "blend", kv_blend=blend)
    blended = ask(shift_server, msgs + LATER, sid, CLEAR, "blend", kv_blend=blend)
    kv = kv_report(blended)
    assert kv["mode"] == "blend" and kv["strategy"] == strategy and kv["fraction"] == 0.3
    assert kv["fallback"] is None and "blend_error" not in kv, kv
    assert kv["block_size"] == 128 and kv["recompute_tokens"] % 128 == 0 and kv["recompute_tokens"] >= 128
    assert kv["movable_tokens"] > kv["recompute_tokens"]
    if strategy == "cuts":   # the blocks after the first cut sit in the middle: a pass recomputes them
        assert kv["passes"] >= 1 and kv["pass_computed_tokens"] >= 128 * kv["passes"]
        assert kv["reused_tokens"] > 0   # after the pass, from its blocks on
    if strategy == "deviation":
        assert kv["probe_s"] > 0
    assert kv["reused_tokens"] + kv["pass_reused_tokens"] > 0
    same_logprobs(blended, recomputed(shift_server, msgs, msgs + LATER))


def test_blend_field_out_of_range_is_a_400(shift_server):
    r = shift_server.http().post("/v1/chat/completions", json={
        "model": "agentkv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "kv_reuse": "blend", "kv_blend": {"strategy": "tail", "fraction": 1.5}})
    assert r.status_code == 400 and "kv_blend" in r.text and "fraction" in r.text, r.text


def test_anthropic_messages_reuse_kv_with_the_servers_default_mode(shift_server):
    """/v1/messages (what Claude Code sends: Anthropic's clearing edit, no agentkv fields) gets the
    server's --kv-reuse: the clear's K/V is moved, and the outcome is in the edit's report."""
    msgs = [{"role": "user", "content": "run the checks"}]
    for i, svc in enumerate(("media", "auth", "billing")):
        out = "\n".join(f"{svc} probe {j}: latency {j * 7 % 300} ms ok" for j in range(70))
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "bash",
                                                    "input": {"cmd": f"diag {svc}"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": out}]}]
    tools = [{"name": "bash", "description": "run a command",
              "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
    clear = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    sid = f"a-{uuid.uuid4().hex[:8]}"

    def send(messages, cm):
        r = shift_server.http().post("/v1/messages", headers={"X-Session-Id": sid}, json={
            "model": "agentkv-tiny", "system": "agent", "messages": messages, "tools": tools, "max_tokens": 1,
            "temperature": 0, "context_management": cm})
        assert r.status_code == 200, r.text
        return r.json()

    send(msgs, {"edits": []})
    body = send(msgs[:-1] + [{"role": "user", "content": msgs[-1]["content"] + [
        {"type": "text", "text": "which service is slow?"}]}], clear)
    (edit,) = body["context_management"]["applied_edits"]
    assert edit["type"] == "clear_tool_uses_20250919" and edit["cleared_tool_uses"] == 2
    assert edit["kv"]["mode"] == "shift" and edit["kv"]["fallback"] is None and edit["kv"]["reused_tokens"] > 0, edit
    assert body["usage"]["cache_read_input_tokens"] >= edit["kv"]["reused_tokens"]


def test_a_summary_moves_the_kept_tails_kv_too(shift_server):
    """A summary replaces the oldest messages by one: one span of the prompt, so with shift the kept
    tail's K/V move like a clear's (before, a summary recomputed everything after it in every mode)."""
    msgs = conversation(lines=60)
    sid = f"s-{uuid.uuid4().hex[:8]}"
    ask(shift_server, msgs, sid, NONE, "shift")                                    # held
    compact = {"edits": [{"type": "compact", "trigger": 0, "keep_recent_tokens": 1000, "summary_max_tokens": 24}]}
    body = ask(shift_server, msgs + LATER, sid, compact, "shift")
    (edit,) = body["context_management"]["applied_edits"]
    assert edit["type"] == "compact" and 3 <= edit["summarized_messages"] <= 5, edit
    assert edit["kv"]["mode"] == "shift" and edit["kv"]["fallback"] is None and edit["kv"]["reused_tokens"] >= 512, edit
    assert cached(body) >= edit["kv"]["reused_tokens"]
