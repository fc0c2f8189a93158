"""Benchmark logic that needs no engine: KV formulas and recall scoring."""

from __future__ import annotations

import json
import statistics

import pytest

from agentkv.benchmarks.kv_memory import known_configs, kv_bytes
from agentkv.benchmarks.scenario import FACTS, SERVICES, Scenario, score


def test_kv_bytes_for_known_shapes():
    cfgs = known_configs()
    assert kv_bytes(cfgs["llama-3-8b"], 1) == 2 * 32 * 8 * 128 * 2           # 128 KiB per token
    assert kv_bytes(cfgs["llama-3-8b"], 1000, "fp8") == 1000 * 2 * 32 * 8 * 128
    assert kv_bytes(cfgs["qwen2.5-7b"], 1) == 2 * 28 * 4 * 128 * 2           # GQA: 4 KV heads
    assert kv_bytes(cfgs["deepseek-v3"], 1) == 61 * (512 + 64) * 2           # MLA latent + rope key
    gemma = cfgs["gemma-2-9b"]                                               # 21 sliding + 21 full layers
    per_layer = 2 * 8 * 256 * 2
    assert kv_bytes(gemma, 10_000) == 21 * per_layer * 10_000 + 21 * per_layer * 4096
    assert kv_bytes(gemma, 100) == 42 * per_layer * 100


def test_kv_bytes_reads_transformers5_dtype_key():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "dtype": "float32"}
    assert kv_bytes(cfg, 1) == 2 * 2 * 2 * 32 * 4


@pytest.mark.parametrize("answer, expected, outcome", [
    ("8443", "8443", "correct"), ("The port is 8443.", "8443", "correct"),
    ("E2033 E3201 E5179", "E2033 E3201 E5179", "correct"), ("Not sure.", "8443", "not_sure"),
    ("I don't know", "x", "not_sure"), ("8080", "8443", "invented"), ("", "1", "invented"),
])
def test_score(answer, expected, outcome):
    assert score(answer, expected) == outcome


def test_scenario_is_seeded_and_plants_every_asked_fact():
    a, b, c = Scenario.make(3), Scenario.make(3), Scenario.make(4)
    assert a.opening == b.opening and a.questions == b.questions and a.opening != c.opening
    assert len(a.questions) == 12 and {q.phase for q in a.questions} == {0, 1, 2}
    reports = {SERVICES[i]: a.opening[3 + 2 * i]["content"] for i in range(len(SERVICES))}
    for q in a.questions:
        assert q.fact in FACTS and f"The {q.fact} of the {q.service} service is {q.answer}." in reports[q.service]
    assert all(len(r.splitlines()) == 1 + 5 + len(FACTS) for r in reports.values())   # header, noise, facts
    assert all(len(turn[1]["content"].splitlines()) == 45 for turn in a.reading_turns)


def test_relay_intervals_and_verdict():
    """The bench front's verdict: rounds resampled; a difference the rounds cannot resolve against
    its goal reads "unresolved", never met or missed."""
    from agentkv.benchmarks.front import median_ratio, rank_difference, resampled_interval, rounds_at, verdict

    steady = [[10.0, 10.2, 10.1]] * 8
    ttft = resampled_interval([[t + 2.0 for t in r] for r in steady], steady, rank_difference, paired=True)
    decode = resampled_interval([99.0, 100.0, 101.0] * 3, [100.0, 101.0, 102.0] * 3, median_ratio)
    assert ttft[0] == ttft[1] == pytest.approx(2.0) and 0.95 < decode[0] <= 0.99 <= decode[1] <= 1.01
    assert verdict(decode, ttft) == "met"
    # bursts that swing by 100s of ms either way: the interval spans the goal
    swinging = [[100.0 * (i % 3)] * 4 for i in range(6)]
    ttft = resampled_interval(swinging, swinging[::-1], rank_difference, paired=True)
    assert ttft[0] < 0 < 5 < ttft[1] and verdict((1.0, 1.0), ttft) == "unresolved"
    assert verdict((0.5, 1.2), (0.0, 1.0)) == "unresolved"   # a starved client's decode rounds
    assert verdict((0.90, 0.94), (0.0, 1.0)) == "missed" and verdict((1.0, 1.0), (5.5, 9.0)) == "missed"
    # two streams whose prefills take turns (~200 and ~400 ms): 2 ms later at each rank reads +2,
    # where the p50 of all samples falls between the modes and moves with the slowest first
    a = [[203.0 + i, 402.0 + i] for i in range(8)]
    b = [[201.0 + i, 400.0 + i] for i in range(7)] + [[260.0, 400.0]]
    assert rank_difference(a, b) == pytest.approx(2.0)
    assert statistics.median(t for r in a for t in r) - statistics.median(t for r in b for t in r) < -20
    assert [rounds_at(c, 4, 32) for c in (1, 2, 4, 8, 64)] == [32, 16, 8, 4, 4] and rounds_at(1, 2, 0) == 2


def test_a_server_that_is_not_ready_in_time_is_stopped_with_all_it_started():
    """A benchmark's server that does not become ready in time (one replica of ``bench replicas``
    once): the error names it, and its process group is gone, the engine it was starting included."""
    import os
    import time

    import psutil
    import pytest

    from agentkv.benchmarks.harness import Endpoint

    started = time.time()
    ep = Endpoint(serve_args=("--model", "agentkv-tiny"), startup_timeout_s=8)
    with pytest.raises(RuntimeError, match="not ready within 8 s"):
        with ep:
            pass
    assert ep.proc is None

    def left() -> list:   # the server's group, and any vLLM started since (its engine: a group of its own)
        out = []
        for p in psutil.process_iter():
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if os.getpgid(p.pid) == ep.pid or (p.create_time() >= started - 1
                                                    and "vllm.entrypoints" in " ".join(p.cmdline())):
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return out

    deadline = time.monotonic() + 60   # the engine gets SIGTERM with its front's death and shuts down
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []


def test_sessions_copies_are_sessions_of_their_own_and_usage_reads_both_apis():
    from agentkv.benchmarks.session_record import DATA, load
    from agentkv.benchmarks.sessions import copy_of, overall, summary, usage_of

    for name in ("claude-code-2.1.332", "codex-0.171.0"):
        req = load(DATA / f"{name}.json.xz")["requests"][3]
        a, b = copy_of(req, 0, "m", "run1"), copy_of(req, 1, "m", "run1")
        assert a[0] == b[0] and a[0] in ("/v1/messages", "/v1/responses")
        assert a[2]["model"] == "m" and a[2]["stream"] is False
        assert json.dumps(a[2]) != json.dumps(b[2])                # a distinct first line: no shared cache
        assert (a[1], a[2].get("prompt_cache_key")) != (b[1], b[2].get("prompt_cache_key"))   # its own session
        assert copy_of(req, 0, "m", "run1") == a and req["body"]["model"] != "m"     # the recording untouched
    assert usage_of({"usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 1}}) == (100, 90)
    assert usage_of({"usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64},
                               "output_tokens": 1}}) == (100, 64)
    ok = [{"session": 0, "turn": t, "status": 200, "latency_s": 1.0, "prompt_tokens": 100 + t, "computed": 10,
           "edits": ["clear_tool_uses"] if t == 2 else []} for t in range(4)]
    floor = [dict(r, computed=8) for r in ok]
    s = summary(ok, floor)
    assert s["ratio"] == 1.25 and s["edit_turns"] == [2] and s["max_prompt"] == 103 and s["failed_from_turn"] is None
    failed = ok[:2] + [{"session": 0, "turn": 2, "status": 400, "latency_s": 0.1}]
    assert summary(failed, floor)["failed_from_turn"] == 2 and summary(failed, floor)["ratio"] is None
    # two copies: the ratio is over both, the worst copy's is its own against the same copy's floor
    copies = ok + [dict(r, session=1, computed=20) for r in ok]
    s = summary(copies, floor + [dict(r, session=1) for r in floor])
    assert s["ratio"] == 1.875 and s["worst_copy_ratio"] == 2.5 and s["edits"] == 2 and s["edit_turns"] == [2]
    assert overall({"x": s}, copies)["worst_ratio"] == 2.5 and overall({"x": s}, copies)["edits"] == 2
    moved = [dict(r, kv=[{"reused_tokens": 64}] if r["edits"] else []) for r in ok]
    moved[0]["kv"] = [{"reused_tokens": 0, "fallback": "evicted"}]
    m = overall({"x": summary(moved, floor)}, moved)
    assert (m["kv_edits"], m["kv_edits_reused"], m["kv_reused_tokens"], m["kv_fallbacks"]) == (2, 1, 64, ["evicted"])


def test_sessions_pool_is_set_for_every_arm_but_the_floor():
    from agentkv.benchmarks.sessions import agentkv_args, pool_args

    assert pool_args(None) == ()
    assert pool_args(65537) == ("--block-size=128", "--num-gpu-blocks-override=513")      # whole blocks, rounded up
    shift = agentkv_args("shift", "/m", "m", 65536, 524288)
    assert "--engine-arg=--num-gpu-blocks-override=4096" in shift and "--kv-reuse" in shift
    assert not any("num-gpu-blocks" in a for a in agentkv_args("floor", "/m", "m", 65536, 524288))


def test_public_traces_become_growing_conversations_of_their_scaled_size():
    """kv-cache-tester's traces (the fixture) as Anthropic Messages requests: each request extends
    the previous one (what it answered, then the new tool result or text), the same block hash is
    the same text, sizes follow the trace at the chosen scale, and a trace ends where its client
    rewrote the middle."""
    from agentkv.benchmarks.sessions import copy_of, overall, summary
    from agentkv.benchmarks.traces import append_only, block_text, conversation, load

    traces = load()
    assert len(traces) >= 20 and len({t["id"] for t in traces}) == len(traces)
    t = traces[0]
    reqs = conversation(t, words_per_block=16)
    assert len(reqs) == len(t["requests"]) >= 20
    for a, b in zip(reqs, reqs[1:]):
        ma, mb = a["body"]["messages"], b["body"]["messages"]
        assert mb[:len(ma)] == ma and [m["role"] for m in mb[len(ma):]] == ["assistant", "user"]
        assert (a["body"]["system"], a["body"]["tools"]) == (b["body"]["system"], b["body"]["tools"])
    for req, r in zip(reqs[1:], t["requests"][1:]):
        said, user = req["body"]["messages"][-2:]
        if "tool_result" in r["input_types"]:
            assert said["content"][-1]["type"] == "tool_use"
            assert user["content"][0]["tool_use_id"] == said["content"][-1]["id"]
    words = (sum(len(x["description"].split()) for x in reqs[-1]["body"]["tools"])
             + len(reqs[-1]["body"]["system"].split()))
    assert abs(words - (t["tool_tokens"] + t["system_tokens"]) / 4) < 64        # a quarter scale, to a block
    assert block_text(t["id"], 7, 16) == block_text(t["id"], 7, 16) != block_text(t["id"], 8, 16)
    rewritten = [{"hash_ids": [1, 2, 3]}, {"hash_ids": [1, 2, 4, 5]}, {"hash_ids": [1, 9, 10]}]
    assert append_only(rewritten) == 2
    a, b = copy_of(reqs[3], 0, "m", "r"), copy_of(reqs[3], 1, "m", "r")
    assert a[1]["x-claude-code-session-id"] != b[1]["x-claude-code-session-id"] and a[2]["max_tokens"] == 1
    row = {"session": 0, "turn": 0, "status": 200, "latency_s": 0.5, "prompt_tokens": 10, "computed": 10, "edits": []}
    whole, cut = summary([row], [row]), summary([row, dict(row, turn=1, status=400)], [row, row])
    o = overall({"a": whole, "b": cut}, [row])
    assert (o["sessions"], o["sessions_whole"], o["answered"], o["turns"], o["ratio"]) == (2, 1, 2, 3, 1.0)
