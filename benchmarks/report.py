"""The result sections, rendered from the JSON files under ``benchmarks/results/``: every row, as
measured, with the machine and date, so the READMEs and the files cannot disagree (a test checks).

``agentkv bench report`` rewrites each block between ``<!-- results: NAME -->`` and
``<!-- /results: NAME -->`` in ``benchmarks/README.md`` from ``NAME.json``, and the headline block
(``<!-- headlines -->``) of the top README from a few of them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from agentkv.server.kv_modes import kv_mode

from .front import extra_ms, ratio
from .harness import RESULTS, machine_line
from .replicas import per_replica

README = Path(__file__).resolve().parent / "README.md"           # every result table
TOP_README = Path(__file__).resolve().parents[1] / "README.md"   # the headline numbers
BLOCK = re.compile(r"(<!-- results: ([\w.-]+) -->\n)(.*?)(<!-- /results: \2 -->)", re.S)
HEADLINES = re.compile(r"(<!-- headlines -->\n)(.*?)(<!-- /headlines -->)", re.S)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if v is None:
        return "-"
    return str(v)


def table(columns: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    out += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _kernel(r: dict) -> str:
    return table(["retained tokens", "layers", "backend", "seconds", "GB/s"],
                 [[x["retained_tokens"], x["layers"], x["backend"], x["seconds"], x["gb_per_s"]] for x in r["rows"]])


def _kv_memory(r: dict) -> str:
    meas, served = r["measured"], r["served_model"]
    head = (f"Served `{r['model']}`: **{meas['bytes_per_token']:.0f} B/token measured** from vLLM's allocation "
            f"({meas['allocated_bytes']:,} bytes for {meas['num_blocks']:,} blocks x {meas['block_size']} tokens, "
            f"{meas['dtype']}); the formula gives {served['formula_bytes_per_token']} B/token.\n\n")
    configs = table(["model (config)", "KV dtype", "KiB/token", f"GiB at {r['configs'][0]['context']} tokens"],
                    [[x["model"], x["kv_dtype"], x["kib_per_token"], x["gib_at_context"]] for x in r["configs"]])
    from .kv_memory import series_label

    session = table(["policy", "turn", "prompt tokens", "edits fired", "GiB (served model)", "GiB (Llama-3-8B shapes)"],
                    [[series_label(r["session"], x["policy"]), x["turn"], x["prompt_tokens"],
                      ", ".join(x["edits_fired"]) or "-", x["gib_served_model"], x["gib_if_llama_3_8b"]]
                     for x in r["session"]])
    return (head + configs + f"\n\nKV held at each turn of the delayed-recall session (window {r['window']}):\n\n"
            + session)


def _decode(r: dict) -> str:
    return table(["context", "batch", "TTFT s (mean)", "decode tok/s per request", "aggregate tok/s"],
                 [[x["context"], x["batch"], x["ttft_s_mean"], x["decode_tok_s_per_request"], x["aggregate_tok_s"]]
                  for x in r["rows"]])


def _delayed_recall(r: dict) -> str:
    head = (f"{r['seeds']} seeds, window {r['window']}, answers up to {r['max_tokens']} tokens; "
            "correct by phase: right after reading / after 3 more turns / after 6 more.\n\n")
    return head + table(
        ["setup", "recall tool", "correct", "invented", "not sure", "overflow", "correct by phase",
         "edits fired (runs)", "mean prompt tokens"],
        [[x["setup"], x["recall"], x["correct"], x["invented"], x["not_sure"], x.get("overflow", 0),
          " / ".join(f"{x['correct_by_phase'][p]}/{x['asked_by_phase'][p]}" for p in ("0", "1", "2")),
          ", ".join(f"{k} {v}" for k, v in x["runs_where_edit_fired"].items()) or "none",
          x["mean_prompt_tokens"]] for x in r["rows"]])


def _probe(r: dict) -> str:
    return table(["context the question is asked with", "fact kind", "facts", "kept in summary", "answered correctly"],
                 [[x["instructions"] if x["instructions"] == "full documents" else f"summary ({x['instructions']})",
                   x["kind"], x["facts"], "-" if x["instructions"] == "full documents" else x["kept"], x["correct"]]
                  for x in r["rows"]])


def _clear_vs_recompute(r: dict) -> str:
    return table(["prompt tokens", "mode", "TTFT s", "recomputed tokens", "KL (top-20)", "top-1 agrees",
                  "greedy match"],
                 [[x["context"], x["mode"], x["ttft_s"], x["recomputed_tokens"], x["kl_top"], x["top1_agree"],
                   f"{x['greedy_match']}/{x['greedy_len']}"] for x in r["rows"]])


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _mode_order(x: dict) -> tuple:
    """recompute, shift, each blend strategy by fraction, then the peer."""
    kinds = ["recompute", "shift", "tail", "cuts", "deviation"]
    kind = x["strategy"] if x["strategy"] in kinds else None
    return (x["uses"], kind is None, kinds.index(kind) if kind else 0, x.get("fraction") or 0, x["mode"])


def _fidelity(r: dict) -> str:
    rows = [[x["uses"], x["prompt_tokens"], x["mode"], x["ttft_s"], x["recomputed_tokens"],
             f"{_pct(x['kept_acc'])} of {x['kept_n']}", _pct(x["near_acc"]), _pct(x["far_acc"]),
             f"{_pct(x['ghost_acc'])} of {x['ghost_n']}", x.get("kl_top"), _pct(x.get("top1_agree")),
             _pct(x.get("greedy_match"))] for x in sorted(r["summary"], key=_mode_order)]
    d = r["decision"]
    verdict = "; ".join(f"{v['mode']}: {v['points_below_recompute']:+.1f} points below, {v['ttft_speedup']:.2f}x"
                        for v in d["modes"])
    meeting = ", ".join(d["meeting"]) or "none"
    return (table(["tool uses", "prompt tokens", "mode", "TTFT s", "recomputed tokens", "kept facts right",
                   "near a cut", "far", "ghost answers", "KL (top-20)", "top-1 agrees", "greedy match"], rows)
            + f"\n\n{r['questions']} questions per mode (seeds: {len(r['seeds'])}; KV block size {r['block_size']}). "
            f"At the largest size ({d['prompt_tokens']} tokens; recompute {_pct(d['recompute_kept_acc'])} right, "
            f"TTFT {d['recompute_ttft_s']:.2f} s): {verdict}. Within 1 point of recompute at >= 3x lower TTFT: "
            f"**{meeting}**."
            + (f" agentkv's rows were measured at {r['agentkv_measured_at']}, llama.cpp's (re-run with "
               f"`--peer-only`) at {r['measured_at']}." if r.get("agentkv_measured_at") else ""))


def _reasons(fallbacks: dict[str, int]) -> str:
    """KV fallbacks by reason, ``reason: edits``."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(fallbacks.items())) or "none"


def _load(r: dict) -> str:
    cols = ["sessions x turns", "requests", "errors", "requests/s", "latency p50 s", "latency p99 s",
            "requests with clearing", "logs complete"]
    row = [f"{r['sessions']} x {r['turns']}", r["requests"], r["errors"], r["requests_per_s"], r["latency_p50_s"],
           r["latency_p99_s"], r["requests_with_clearing"], f"{r['logs_complete']}/{r['sessions']}"]
    if kv_mode(r.get("kv_reuse", "recompute")).uses_connector:   # what the KV connector did with the edits
        cols += ["kv_reuse", "KV edits", "KV reused tokens", "KV fallbacks (reason: edits)"]
        row += [r["kv_reuse"], r["kv_edits"], r["kv_reused_tokens"],
                _reasons(r["kv_fallbacks"])]
        if "kv_edits_reused" in r:   # runs since the host tier: its size, the share reused, its counters
            tier = r.get("host_tier") or {}
            gib = r.get("kv_offload_gib")
            cols += ["host tier", "edits reused (of those long enough)", "blocks spilled / restored / dropped",
                     "per restore"]
            row += ["off" if gib == 0 else "server default" if gib is None else f"{gib:g} GiB",
                    f"{r['kv_edits_reused']}/{r['kv_edits_reusable']}",
                    " / ".join(str(int(tier.get(k, 0))) for k in ("spilled_blocks", "restored_blocks",
                                                                    "dropped_blocks")),
                    f"{tier['bytes_per_restore'] / 2**20:.1f} MiB in {tier['ms_per_restore']:.1f} ms"
                    if tier.get("restores") else "-"]
    return table(cols, [row])


def _replicas(r: dict) -> str:
    cols = ["arm", "requests", "errors", "prefix-cache hit rate per session: mean", "min", "KV edits",
            "KV reused tokens", "KV fallbacks (reason: edits)", "responses per replica (log reads included)",
            "logs complete", "latency p50 s"]
    return table(cols, [[name, a["requests"], a["errors"], _pct(a["hit_rate_mean"]), _pct(a["hit_rate_min"]),
                         a["kv_edits"], a["kv_reused_tokens"],
                         _reasons(a["kv_fallbacks"]), per_replica(a),
                         f"{a['logs_complete']}/{r['sessions']}", a["latency_p50_s"]] for name, a in r["arms"].items()])


def _engine_input(r: dict) -> str:
    cols = ["prompt tokens", "way", "TTFT median ms", "against vLLM with messages: median ms [2.5%, 97.5%]",
            "ratio: median [2.5%, 97.5%]", "vLLM's render ms", "front CPU ms / request",
            "vLLM API server CPU ms / request"]
    return table(cols, [[x["tokens"], x["way"], x["median_ms"],
                         f"{x['vs_vllm_messages_median_ms']:+.1f} [{x['vs_vllm_messages_p2_5_ms']:+.1f}, "
                         f"{x['vs_vllm_messages_p97_5_ms']:+.1f}]",
                         f"{x['ratio_to_vllm_messages']:.2f} [{x['ratio_p2_5']:.2f}, {x['ratio_p97_5']:.2f}]",
                         x["vllm_render_ms"], x["front_cpu_ms"], x["vllm_api_server_cpu_ms"]] for x in r["rows"]])


def _connector_cost(r: dict) -> str:
    goal = f"goal {r['goal']:.0%}"
    head = table(["metric", "median on", "median off", "median paired on/off", "pairs", "cost", goal],
                 [[k, x["median_on"], x["median_off"], x["median_paired_ratio"], x["pairs"],
                   "-" if x["cost"] is None else f"{x['cost']:+.1%}", "met" if x["goal_met"] else "not met"]
                  for k, x in r["summary"].items()])
    rows = table(["session", "turn", "connector", "prompt tokens", "TTFT s", "decode tokens/s"],
                 [[x["session"], x["turn"], x["connector"], x.get("prompt_tokens"), x["ttft_s"], x["decode_tps"]]
                  for x in r["rows"]])
    return (f"{r['sessions']} sessions x {r['turns']} turns, requests that never clear:\n\n{head}\n\n"
            f"Every request:\n\n{rows}")


def _front(r: dict) -> str:
    prompt = table(["part", "mode", "conversation tokens", "new tokens a request", "cold ms", "ms per request",
                    "CPU ms per request"],
                   [[x["part"], x["mode"], x["tokens"], x.get("new_tokens", x.get("new_tokens_per_request", "-")),
                     x.get("cold_ms"), x["per_request_ms"], x["per_request_cpu_ms"]] for x in r["prompt"]])
    out = f"Prompt work per request (tokenizer `{r['tokenizer']}`):\n\n" + prompt
    if r.get("engine_render"):
        out += ("\n\nvLLM's own prompt work per chat request, the same conversations (its `/tokenize`: the chat "
                "template rendered whole and tokenized, as its chat route does on every request):\n\n")
        out += table(["model", "conversation tokens", "engine tokens", "ms per request"],
                     [[x["model"], x["tokens"], x["engine_tokens"], x["per_request_ms"]] for x in r["engine_render"]])
    if r["relay_summary"]:
        tokens = ", ".join(f"{m} {n}" for m, n in {x["model"]: x["tokens_per_request"] for x in r["relay"]}.items())
        out += (f"\n\nRelay, streamed, tokens a request: {tokens}; through agentkv vs the engine directly "
                "(A/B interleaved; decode: median over rounds, TTFT: p50 of all requests; TTFT extra: how much "
                "later a first token comes through agentkv, the k-th of a burst against the k-th of the adjacent "
                "direct burst, median over rounds and ranks; ratio and extra with 95% intervals, rounds "
                "resampled; goal: decode ratio at least 0.95 and TTFT extra at most 5 ms, met when both intervals "
                "are inside, unresolved when one spans its bound):\n\n")
        out += table(["model", "streams", "agentkv decode tok/s", "engine decode tok/s", "ratio [95%]",
                      "end-to-end ratio", "rounds", "agentkv TTFT p50 ms", "engine TTFT p50 ms",
                      "TTFT extra ms [95%]", "front before the engine ms p50 / p90", "front CPU µs/event",
                      "vLLM API server CPU µs/event", "goal"],
                     [[x["model"], x["concurrency"], x["agentkv_tok_s"], x["engine_tok_s"],
                       ratio(x), x["e2e_ratio"], x["rounds"], x["agentkv_ttft_p50_ms"],
                       x["engine_ttft_p50_ms"], extra_ms(x),
                       f"{x['front_ms_p50']:.1f} / {x['front_ms_p90']:.1f}" if "front_ms_p50" in x else "-",
                       x.get("front_cpu_us_per_event", "-"),
                       x.get("vllm_api_cpu_us_per_event", "-"), x["goal"]]
                      for x in r["relay_summary"]])
    return out


def _sessions(r: dict) -> str:
    copies = r.get("copies", r["concurrent"])      # results before --copies: every copy at once
    head = (f"{r.get('workload', 'recorded client sessions')}, {r['model']}, window {r['window']} tokens, "
            f"{copies} cop{'y' if copies == 1 else 'ies'} of each, {r['concurrent']} at once"
            + (f" (pauses of {r['think_s']} s on average between a session's turns)" if r["concurrent"] > 1 else "")
            + (f"; a KV pool of {r['pool_tokens']:,} tokens for every arm but the floor" if r.get("pool_tokens")
               else "") + "\n\n")
    if "overall" in r:
        head += table(["arm", "sessions answered whole", "turns answered", "tokens computed", "floor", "x floor",
                       "worst session x floor", "edits", "largest prompt", "latency p50 s", "latency p99 s",
                       "KV reused tokens", "KV fallbacks"],
                      [[arm, f"{a['sessions_whole']}/{a['sessions']}", f"{a['answered']}/{a['turns']}",
                        *((a["computed"], a["floor"], _times(a["ratio"]), _times(a["worst_ratio"])) if a["floor"]
                          else ("", "", "", "")), a["edits"], a["max_prompt"],
                        a["latency_p50_s"], a["latency_p99_s"], a["kv_reused_tokens"], ", ".join(a["kv_fallbacks"])]
                       for arm, a in r["overall"].items()]) + "\n\nPer session:\n\n"
    cols = ["session", "arm", "turns answered", "first failed turn", "tokens computed", "x floor", "turns with an edit",
            "largest prompt", "latency p50 s", "latency p99 s", "KV reused tokens", "KV fallbacks"]
    rows = []
    for name, sess in r["sessions"].items():
        for arm, a in sess["summary"].items():
            rows.append([name, arm, f"{a['answered']}/{a['turns']}", "" if a["failed_from_turn"] is None
                         else a["failed_from_turn"], a["computed"], "" if a["ratio"] is None else f"{a['ratio']:.2f}",
                         len(a["edit_turns"]), a["max_prompt"], a["latency_p50_s"], a["latency_p99_s"],
                         a["kv_reused_tokens"], ", ".join(a["kv_fallbacks"])])
    return head + table(cols, rows)


def _gpu_check(r: dict) -> str:
    cases = table(["case", "dtype", "blocks", "max error vs torch", "max error vs loop", "atol / rtol",
                   "slots written", "pass"],
                  [[x["name"], x["dtype"], f"{x['src_block']} -> {x['dst_block']}", x["max_abs_err_vs_torch"],
                    x["max_abs_err_vs_loop"], f"{x['atol']} / {x['rtol']}",
                    f"{x['slots_written']}/{x['slots_expected']}", x["passed"]] for x in r["correctness"]])
    bw = table(["retained tokens", "layers", "backend", "kernel ms", "kernel GB/s", "torch copy GB/s", "ratio"],
               [[x["tokens"], x["layers"], x["kernel_backend"], x["kernel_ms"], x["kernel_gb_per_s"],
                 x["copy_gb_per_s"], x["ratio"]] for x in r["bandwidth"]])
    return (f"Correctness (Triton against the torch path and the per-token loop, whole caches):\n\n{cases}\n\n"
            f"`apply_plan` over Llama-3-8B KV (bf16, block 16), read + written, against a torch copy of the same "
            f"bytes (goal: ratio >= {r['goal']['target_ratio']}; met: {_fmt(r['goal']['met'])}):\n\n{bw}")


def _gpu_prefill(r: dict) -> str:
    return (f"{r['model']}, median of {len(r['rows'][0]['all_s'])} runs:\n\n" +
            table(["tokens", "prefill s", "all runs s", "KV GiB", "K/V read + write at 4.3 TB/s, ms"],
                  [[x["tokens"], x["prefill_s"], ", ".join(f"{t:.3g}" for t in x["all_s"]), x["kv_gib"],
                    x["move_floor_ms_at_4.3TBps"]] for x in r["rows"]]))


def _rows(r: dict) -> str:
    """Any benchmark with a list of flat ``rows``: every column of every row."""
    rows = r["rows"]
    cols = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    return table(cols, [[x.get(c) for c in cols] for x in rows])


def _capacity(r: dict) -> str:
    """The capacity curve: each pool size and arm against the floor."""
    f = r["floor"]["overall"]
    sessions = ", ".join(r["sessions"])
    head = (f"{len(r['sessions'])} recorded sessions ({sessions}) x {r['copies']} copies, {r['concurrent']} at once "
            f"(pauses of {r['think_s']} s on average between a session's turns), {r['model']}, window "
            f"{r['window']:,} tokens; the floor: {f['answered']}/{f['turns']} turns, {f['computed']:,} tokens computed "
            f"(its own unbounded pool), latency p50/p99 {f['latency_p50_s']}/{f['latency_p99_s']} s\n\n")
    rows = []
    for w in r["pool_windows"]:
        pool = r["pools"][str(w)]
        for arm, a in pool["arms"].items():
            o, c = a["overall"], a["overall"].get("connector") or {}
            rows.append([f"{w} ({pool['pool_tokens']:,})", arm, f"{o['answered']}/{o['turns']}",
                         _times(o["ratio"]) if o["ratio"] is not None else "",
                         _times(o["worst_ratio"]) if o["worst_ratio"] is not None else "",
                         o["latency_p50_s"], o["latency_p99_s"], c.get("retained_tokens_per_turn", ""),
                         c.get("restore_mib_per_turn", ""), o["kv_reused_tokens"], ", ".join(o["kv_fallbacks"])])
    return head + table(["pool, windows (tokens)", "arm", "turns answered", "tokens computed x floor",
                         "worst copy x floor", "latency p50 s", "latency p99 s", "read back tokens/turn",
                         "restored MiB/turn", "KV moved by edits", "fallbacks"], rows)


RENDERERS: dict[str, Callable[[dict], str]] = {
    "sessions-capacity": _capacity,
    "kernel": _kernel, "kv-memory": _kv_memory, "decode-throughput": _decode, "delayed-recall": _delayed_recall,
    "probe": _probe, "clear-vs-recompute": _clear_vs_recompute, "load": _load, "load-shift": _load,
    "load-shift-no-tier": _load, "load-blend": _load, "connector-cost": _connector_cost, "front": _front,
    "front-prompt": _front,
    "fidelity": _fidelity,
    "gpu_check": _gpu_check, "gpu-prefill": _gpu_prefill, "replicas": _replicas,
    "engine-input": _engine_input,
}


def _load_result(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def _where(r: dict, name: str) -> str:
    return (f"[`{name}`](benchmarks/README.md#{name}), {r['measured_at'][:10]}, "
            f"{machine_line(r['machine']).replace(' | ', ', ')}")


def headlines(results: Path = RESULTS) -> str:
    """The top README's few numbers, each with its file, date and machine."""
    gpu, pre = _load_result(results, "gpu_check"), _load_result(results, "gpu-prefill")
    move = {x["tokens"]: x for x in gpu["bandwidth"]}
    fill = {x["tokens"]: x for x in pre["rows"]}
    rows = []
    for n in sorted(set(move) & set(fill)):
        m, f = move[n], fill[n]
        rows.append([f"{n:,} tokens of Llama-3-8B KV: clearing moves them (Triton)",
                     f"{m['kernel_ms']:.2f} ms ({m['kernel_gb_per_s']:,.0f} GB/s)",
                     f"recompute (prefill): {f['prefill_s']:.2f} s, "
                     f"{f['prefill_s'] * 1e3 / m['kernel_ms']:,.0f}x the move",
                     _where(gpu, "gpu_check") + "; " + "[`gpu-prefill`](benchmarks/README.md#gpu-prefill)"])
    cases = gpu["correctness"]
    rows.append(["Triton kernel correctness on the GPU", f"{sum(c['passed'] for c in cases)}/{len(cases)} cases pass",
                 "against the torch path and a per-token loop, whole caches", _where(gpu, "gpu_check")])
    kv = _load_result(results, "kv-memory")
    rows.append([f"KV per token, `{kv['model']}` (vLLM's allocation)", f"{kv['measured']['bytes_per_token']:,.0f} B",
                 f"formula: {kv['served_model']['formula_bytes_per_token']:,} B", _where(kv, "kv-memory")])
    cvr = _load_result(results, "clear-vs-recompute")
    rows.append(["TTFT after a clear, shift vs recompute (CPU, largest conversation)",
                 f"{cvr['speedup_shift_vs_recompute_at_largest']:.1f}x lower", f"`{cvr['model']}`",
                 _where(cvr, "clear-vs-recompute")])
    prompt = _load_result(results, "front-prompt")
    ids = [x for x in prompt["prompt"] if x["part"] == "ids"]
    if ids:
        n = max(x["tokens"] for x in ids)
        mine, vllm = (next(x for x in ids if x["tokens"] == n and x["mode"] == m)
                      for m in ("front ids (incremental)", "vLLM chat render"))
        rows.append([f"prompt ids per agent turn at {n:,} tokens (vLLM's own render, exact)",
                     f"agentkv's front {mine['per_request_ms']:.0f} ms (tokenizes what is new)",
                     f"vLLM's chat render of the same request {vllm['per_request_ms']:.0f} ms (tokenizes it all)",
                     _where(prompt, "front-prompt")])
    sessions = results / "sessions.json"
    if sessions.exists():
        r = _load_result(results, "sessions")
        for name, sess in r["sessions"].items():
            a = sess["summary"]
            if not {"vllm", "recompute", "shift"} <= set(a):
                continue
            v = a["vllm"]
            rows.append([f"a real {name} session, {v['turns']} requests, replayed at a {r['window']:,}-token window",
                         f"agentkv answers {a['recompute']['answered']}/{a['recompute']['turns']}: "
                         f"{_times(a['recompute']['ratio'])} the floor's tokens computed (recompute), "
                         f"{_times(a['shift']['ratio'])} (shift)",
                         f"vLLM reached directly answers {v['answered']}/{v['turns']}"
                         + (f" (prompt over the window from turn {v['failed_from_turn']})" if v["failed_from_turn"]
                            is not None else ""), _where(r, "sessions")])
    for name in sorted(p.stem for p in results.glob("sessions-traces*.json")):
        r = _load_result(results, name)
        o = r["overall"]
        if not {"vllm", "recompute", "shift"} <= set(o):
            continue
        rows.append([f"{o['recompute']['sessions']} public Claude Code traces (kv-cache-tester), "
                     f"{r['concurrent']} at once, {r['trace_words']} tokens per 64-token block on a "
                     f"{r['window']:,}-token window",
                     f"agentkv answers {o['recompute']['answered']}/{o['recompute']['turns']} turns: "
                     f"{_times(o['recompute']['ratio'])} the floor's tokens computed over the sessions answered whole "
                     f"(recompute; worst session "
                     f"{_times(o['recompute']['worst_ratio'])}), {_times(o['shift']['ratio'])} (shift; worst "
                     f"{_times(o['shift']['worst_ratio'])}); latency p50/p99 {o['recompute']['latency_p50_s']}/"
                     f"{o['recompute']['latency_p99_s']} s",
                     f"vLLM reached directly answers {o['vllm']['answered']}/{o['vllm']['turns']} turns, "
                     f"{o['vllm']['sessions_whole']}/{o['vllm']['sessions']} sessions whole", _where(r, name)])
    if (results / "sessions-capacity.json").exists():
        r = _load_result(results, "sessions-capacity")
        for w in (4, 2):
            pool = r["pools"].get(str(w))
            if pool is None or not {"recompute", "shift"} <= set(pool["arms"]):
                continue
            a = {arm: x["overall"] for arm, x in pool["arms"].items()}
            eight = r["pools"].get("8", {}).get("arms", {})
            off = [f"{arm.removesuffix('-no-retention')} {_times(a[arm]['ratio'])}"
                   for arm in ("recompute-no-retention", "shift-no-retention") if arm in a]
            n = len(r["sessions"])
            rows.append([f"{n * r['copies']} real client sessions ({n} clients: Claude Code, Codex, opencode, pi), "
                         f"{r['concurrent']} at once on a {r['window']:,}-token window, a KV pool of {w} windows "
                         f"({pool['pool_tokens']:,} tokens)",
                         f"retention: recompute (the default) computes {_times(a['recompute']['ratio'])} the floor's "
                         f"tokens, shift {_times(a['shift']['ratio'])}; latency p99 "
                         f"{a['recompute']['latency_p99_s']}/{a['shift']['latency_p99_s']} s"
                         + (f" (on 8 windows {eight['recompute']['overall']['latency_p99_s']}/"
                            f"{eight['shift']['overall']['latency_p99_s']} s)" if {"recompute", "shift"} <= set(eight)
                            else ""),
                         (f"retention off: {', '.join(off)}" if off else "")
                         + (f"; vLLM reached directly answers {a['vllm']['answered']}/{a['vllm']['turns']} turns"
                            if "vllm" in a else ""),
                         _where(r, "sessions-capacity")])
    tier, no_tier = results / "load-shift.json", results / "load-shift-no-tier.json"
    if tier.exists() and no_tier.exists():
        r, n = _load_result(results, "load-shift"), _load_result(results, "load-shift-no-tier")
        if "kv_edits_reused" in r and "kv_edits_reused" in n:
            rows.append([f"{r['sessions']} agent sessions at once (`bench load --kv-reuse shift`, SmolLM2): edits "
                         "whose held K/V were still there to move, with the host tier",
                         f"{r['kv_edits_reused']}/{r['kv_edits_reusable']} ({r['kv_reused_tokens']:,} tokens moved)",
                         f"without it: {n['kv_edits_reused']}/{n['kv_edits_reusable']} "
                         f"({n['kv_reused_tokens']:,} tokens)",
                         _where(r, "load").replace("[`load`]", "[`load-shift`, `load-shift-no-tier`]")])
    return table(["what", "measured", "against", "file, date, machine"], rows)


def _moved(arm: dict) -> str:
    """How many of an arm's edits moved held K/V, and how many tokens."""
    return (f"{arm['kv_edits_reused']}/{arm['kv_edits']} edits moved their held K/V "
            f"({arm['kv_reused_tokens']:,} tokens)")


def _times(ratio) -> str:
    return "?" if ratio is None else f"{ratio:.2f}x"



def render(name: str, result: dict) -> str:
    """The README block for one results file: where and when it was measured, then its tables."""
    models = result.get("models") or ([result["model"]] if result.get("model") else [])
    caption = (f"*`{name}`: measured {result['measured_at'][:10]} on {machine_line(result['machine'])}"
               f"{', model' + ('s ' if len(models) > 1 else ' ') if models else ''}"
               f"{', '.join(f'`{m}`' for m in models)}; "
               f"`benchmarks/results/{name}.json`.*\n\n")
    renderer = RENDERERS.get(name) or (_sessions if name.split("-")[0] == "sessions" else _rows)
    return caption + renderer(result) + "\n"


def rewrite(readme: str, results: Path = RESULTS) -> str:
    """A README with every results block re-rendered from its JSON file, and the headline block."""
    def block(m: re.Match) -> str:
        name = m.group(2)
        return m.group(1) + render(name, _load_result(results, name)) + m.group(4)

    readme = BLOCK.sub(block, readme)
    return HEADLINES.sub(lambda m: m.group(1) + headlines(results) + "\n" + m.group(3), readme)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="agentkv bench report", description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if a README differs from the results files")
    args = ap.parse_args(argv)
    differ = []
    for path in (README, TOP_README):
        old = path.read_text()
        new = rewrite(old)
        if new != old:
            differ.append(path)
            if not args.check:
                path.write_text(new)
        print(f"{path}: {len(BLOCK.findall(new))} results blocks, {len(HEADLINES.findall(new))} headline blocks")
    if args.check:
        raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
