"""Each engine benchmark at its --quick size against the real server: JSON + PNG, machine named."""

from __future__ import annotations

import json

import pytest

from agentkv.server.cli import main


@pytest.mark.parametrize("name", ["kv-memory", "decode-throughput", "delayed-recall", "probe"])
def test_quick_benchmark_writes_results(server, tmp_path, name):
    main(["bench", name, "--quick", "--url", server.base_url, "--api-key", server.api_key, "--out", str(tmp_path)])
    result = json.loads((tmp_path / f"{name}-quick.json").read_text())
    assert (tmp_path / f"{name}-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["model"] == "agentkv-tiny"
    if name == "kv-memory":
        assert result["measured"]["bytes_per_token"] == result["served_model"]["formula_bytes_per_token"]
        none = [r for r in result["session"] if r["policy"] == "none"]
        cleared = [r for r in result["session"] if r["policy"] == "clearing"]
        assert cleared[-1]["prompt_tokens"] < none[-1]["prompt_tokens"]
    elif name == "decode-throughput":
        assert [(r["context"], r["batch"]) for r in result["rows"]] == [(256, 1), (256, 2), (1024, 1), (1024, 2)]
        for r in result["rows"]:  # every request decoded all its tokens (ignore_eos), after its first one
            assert r["tokens_per_request"] == 8
            assert r["aggregate_tok_s"] == pytest.approx(r["batch"] * 8 / r["wall_s"])
            assert 0 < r["ttft_s_mean"] < r["wall_s"]
    elif name == "delayed-recall":
        assert sum(r["answers"] for r in result["rows"]) == 4 * 12
        assert all(r["correct"] + r["invented"] + r["not_sure"] + r["overflow"] == r["answers"]
                   for r in result["rows"])
        assert result["window"] == 2048                       # --quick: triggers of a 2k window
        assert all(r["asked_by_phase"] == {"0": 4, "1": 4, "2": 4} for r in result["rows"])   # JSON keys
    else:
        assert [r["instructions"] for r in result["rows"]] == ["full documents"] * 2 + ["default"] * 2 + ["guided"] * 2
        assert all(r["facts"] == 2 for r in result["rows"])       # two documents, one fact of each kind
        assert all(f["kept_in_summary"] is None for f in result["facts"]["full documents"])


def test_quick_front_benchmark_writes_results(server, tmp_path):
    """Prompt work (segments against whole renders, SmolLM2's tokenizer) and the relay A/B against
    the test server's own engine, reached on the socket and with the secret of the process it started;
    the CPU each of the server's processes used per streamed event."""
    from agentkv.benchmarks.front import engine_of, processes, relay_rows

    url, key = engine_of(server.proc.pid)
    main(["bench", "front", "--quick", "--url", server.base_url, "--api-key", server.api_key,
          "--engine-url", url, "--engine-key", key, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "front-quick.json").read_text())
    assert (tmp_path / "front-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["models"] == ["agentkv-tiny"] and url.startswith("unix:")
    prompt = [r for r in result["prompt"] if r["part"] == "prompt"]
    assert [(r["mode"], r["tokens"]) for r in prompt][::2] == \
        [("segments", t) for t in sorted({r["tokens"] for r in prompt})]
    for seg, whole in zip(prompt[::2], prompt[1::2]):   # the same conversations, both ways
        assert (whole["mode"], whole["tokens"], whole["new_tokens_per_request"]) == \
            ("whole", seg["tokens"], seg["new_tokens_per_request"])
    new = [r["new_tokens"] for r in result["prompt"] if r["part"] == "new"]
    assert len(new) == 2 and 0 < new[0] < new[1]
    ids = [r for r in result["prompt"] if r["part"] == "ids"]   # the ids sent (equal to vLLM's: checked there)
    assert [r["mode"] for r in ids] == ["front ids (incremental)", "vLLM chat render"] * 2
    assert all(r["per_request_ms"] > 0 for r in ids)
    # vLLM's own render + tokenize of the same conversations, on its /tokenize route
    render = result["engine_render"]
    sizes = sorted({r["tokens"] for r in prompt})
    assert [(r["model"], r["tokens"]) for r in render] == [("agentkv-tiny", t) for t in sizes]
    assert all(r["engine_tokens"] > 1000 and r["per_request_ms"] > 0 for r in render)
    relay = result["relay"]
    assert sorted((r["target"], r["concurrency"]) for r in relay) == \
        [("agentkv", 1), ("agentkv", 4), ("engine", 1), ("engine", 4)]
    assert all(r["decode_tok_s"] > 0 and len(r["decode_tok_s_rounds"]) == 2 for r in relay)
    for s in result["relay_summary"]:
        a, e = (next(r for r in relay if r["target"] == t and r["concurrency"] == s["concurrency"])
                for t in ("agentkv", "engine"))
        assert s["throughput_ratio"] == pytest.approx(a["decode_tok_s"] / e["decode_tok_s"])
        lo, hi = s["ttft_extra_interval_ms"]   # two rounds resampled: the interval, and a verdict on it
        assert lo <= hi and s["rounds"] == 2 and s["goal"] in ("met", "missed", "unresolved")
        assert s["throughput_ratio_interval"][0] <= s["throughput_ratio_interval"][1]
        # the front's own time before the engine, from its Server-Timing; vLLM sends none
        assert 0 < a["context_ms_p50"] <= a["front_ms_p50"] == s["front_ms_p50"] and "front_ms_p50" not in e
    roles = processes(server.proc.pid)
    assert roles["front"][0].pid == server.proc.pid and roles["vllm api server"] and roles["engine core"]
    rows = relay_rows((server.base_url, server.api_key), (url, key), "agentkv-tiny", [2], 4, 1, lambda: None,
                      roles=roles)
    front, direct = (next(r for r in rows if r["target"] == t) for t in ("agentkv", "engine"))
    assert front["events"] >= 2 * 4 and direct["events"] >= 2 * 4     # a role chunk, tokens, usage
    for row in (front, direct):   # CPU clock ticks are 10 ms: a role may show 0 in so short a run, not all
        cpu = row["cpu_us_per_event"]
        assert set(cpu) == {"front", "vllm api server", "engine core", "worker"} and min(cpu.values()) >= 0
        assert sum(cpu.values()) > 0


def test_quick_replicas_benchmark_writes_results(haproxy, tmp_path):
    """Two tiny-model replicas of its own, one replica alone, then the deployed router, then round
    robin: every arm answers every request and keeps every log; the router spreads sessions."""
    main(["bench", "replicas", "--quick", "--model", "agentkv-tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "replicas-quick.json").read_text())
    assert (tmp_path / "replicas-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["model"] == "agentkv-tiny"
    arms = result["arms"]
    assert list(arms) == ["one replica", "router, 2 replicas", "round robin, 2 replicas"]
    for arm in arms.values():
        assert (arm["requests"], arm["errors"], arm["logs_complete"]) == (16, 0, 4)
        assert len(arm["session_hit_rates"]) == 4 and all(0 <= h <= 1 for h in arm["session_hit_rates"])
    assert set(arms["round robin, 2 replicas"]["served_by"]) == {"replica1", "replica2"}
    assert arms["router, 2 replicas"]["hit_rate_mean"] > 0


def test_quick_engine_input_benchmark_writes_results(tmp_path):
    """Its own server (the tiny model with a 256k window), reached four ways, interleaved."""
    main(["bench", "engine-input", "--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "engine-input-quick.json").read_text())
    assert (tmp_path / "engine-input-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["model"] == "agentkv-tiny-wide"
    rows = result["rows"]
    ways = ["agentkv (token ids)", "agentkv (messages)", "vLLM, messages", "vLLM, token ids"]
    assert [r["way"] for r in rows] == ways * 2
    for r in rows:
        assert len(r["all_ms"]) == 3 and r["median_ms"] > 0
        # the same prompt every way, its history prefix-cached: only the new message is computed
        assert r["tokens"] == rows[4 * (rows.index(r) // 4)]["tokens"] >= 2000
        assert all(c is not None and c >= 0.8 * r["tokens"] for c in r["cached_tokens"]), r["cached_tokens"]
        assert r["ratio_p2_5"] <= r["ratio_to_vllm_messages"] <= r["ratio_p97_5"]
        assert isinstance(r["faster_than_vllm_messages_by_render"], bool)
    # each agentkv way went the way it names (a prefill and 3 rounds per size)
    assert result["engine_input_requests"] == {"tokens": 8, "messages:request": 8}
    assert all(r["vs_vllm_messages_median_ms"] == 0 for r in rows if r["way"] == "vLLM, messages")
