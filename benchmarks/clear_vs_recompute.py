"""Clearing vs recompute: TTFT of the request after a mid-conversation clear under each KV mode
(recompute, shift, blend), tokens recomputed, and fidelity against recompute (KL divergence of the
next-token distribution over the top logprobs, top-1 agreement, greedy-continuation match length).

Starts its own server with the KV connector (``--kv-reuse shift``, the default model
SmolLM2-135M-Instruct unless ``--model``) unless ``--url`` is given.
Usage: ``agentkv bench clear-vs-recompute [--quick] [--model NAME] [--contexts ...]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid

from agentkv.server.embedded_model.names import DEFAULT_MODEL
from agentkv.server.options import KV_MODES

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results

MODES = KV_MODES
TOP = 20


def conversation(context: int) -> list[dict]:
    """System + task, then tool uses of ~600 tokens each until about ``context`` tokens."""
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Run the checks."}]
    i = 0
    while 60 + 620 * (i + 1) <= context:
        out = "\n".join(f"check {i}.{j}: service ok latency {(i * 31 + j * 7) % 400} ms" for j in range(45))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"n": i})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": out}]
        i += 1
    return msgs


def clear_middle(n_uses: int) -> dict:
    """Clear every tool result but the newest third: the cleared spans sit between the task and the
    kept recent tool uses, whose K/V shift moves."""
    return {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": max(1, n_uses // 3)}]}


def ask(http, model, msgs, sid, cm, mode, max_tokens, stream=False):
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP, "context_management": cm, "kv_reuse": mode, "cache_salt": sid}
    t0 = time.perf_counter()
    if not stream:
        r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code} from the server: {r.text[:500]}")
        return r.json(), time.perf_counter() - t0
    first, chunks = None, []
    with http.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid},
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunk = json.loads(line[5:])
                choice = (chunk.get("choices") or [{}])[0]
                if first is None and ((choice.get("delta") or {}).get("content")
                                      or (choice.get("logprobs") or {}).get("content")):
                    first = time.perf_counter() - t0
                chunks.append(chunk)
    return chunks, first


def as_body(chunks: list[dict]) -> dict:
    """The streamed chunks' per-token logprobs, shaped like a non-streamed response."""
    content = [lp for c in chunks if c.get("choices") for lp in ((c["choices"][0].get("logprobs") or {})
                                                                 .get("content") or [])]
    return {"choices": [{"logprobs": {"content": content}}]}


def fidelity(ref: dict, got: dict) -> dict:
    """KL(ref || got) over ref's top tokens at the first position, top-1 agreement, and how many
    greedy tokens match before the first difference."""
    r0 = ref["choices"][0]["logprobs"]["content"]
    g0 = got["choices"][0]["logprobs"]["content"]
    p = {t["token"]: t["logprob"] for t in r0[0]["top_logprobs"]}
    q = {t["token"]: t["logprob"] for t in g0[0]["top_logprobs"]}
    floor = min(q.values()) if q else -50.0
    kl = sum(math.exp(lp) * (lp - q.get(tok, floor)) for tok, lp in p.items())
    match = 0
    for a, b in zip(r0, g0):
        if a["token"] != b["token"]:
            break
        match += 1
    return {"kl_top": kl, "top1_agree": r0[0]["token"] == g0[0]["token"], "greedy_match": match,
            "greedy_len": len(r0)}


def run(ep: Endpoint, contexts: list[int], max_tokens: int) -> list[dict]:
    rows = []
    with ep.http() as http:
        model = ep.model()["id"]
        for context in contexts:
            msgs = conversation(context)
            later = msgs + [{"role": "user", "content": "Summarize the slow checks."}]
            cm = clear_middle(sum(1 for m in msgs if m.get("role") == "tool"))
            results = {}
            for mode in MODES:
                sid = f"cvr-{mode}-{uuid.uuid4().hex[:8]}"
                ask(http, model, msgs, sid, {"edits": []}, mode, 1)          # the saved source prompt
                chunks, ttft = ask(http, model, later, sid, cm, mode, max_tokens, stream=True)
                usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
                report = next(c["context_management"] for c in reversed(chunks) if c.get("context_management"))
                results[mode] = (ttft, usage, report, as_body(chunks))
            ref = results["recompute"][3]
            for mode, (ttft, usage, report, body) in results.items():
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                rows.append({"context": usage["prompt_tokens"], "target_context": context, "mode": mode,
                             "ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                             "recomputed_tokens": usage["prompt_tokens"] - cached,
                             "cleared_tokens": report["applied_edits"][0]["cleared_input_tokens"]
                             if report["applied_edits"] else 0, **fidelity(ref, body)})
    return rows


def plot(rows: list[dict], title: str):
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        a.plot([r["context"] for r in rs], [r["ttft_s"] for r in rs], "o-", label=mode)
        b.plot([r["context"] for r in rs], [r["recomputed_tokens"] for r in rs], "o-", label=mode)
    a.set_ylabel("TTFT after clearing (s)")
    b.set_ylabel("prompt tokens recomputed")
    for ax in (a, b):
        ax.set_xlabel("prompt tokens after clearing")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench clear-vs-recompute", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two small contexts (smoke test)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096],
                    help="conversation sizes to build, in estimated tokens before clearing (SmolLM2's tokenizer "
                         "makes them about a third larger; the default fits its 8192-token window)")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"model of the server started for the run (default: {DEFAULT_MODEL}; agentkv-tiny-1l: "
                         "the exactness model)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy continuation length compared")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    contexts = [1024, 2048] if args.quick else args.contexts
    serve_args = () if args.url else ("--model", args.model, "--kv-reuse", "shift")
    with Endpoint(args.url, args.api_key, serve_args) as ep:
        model = ep.model()["id"]
        rows = run(ep, contexts, 4 if args.quick else args.max_tokens)
    m = machine()
    largest = max(r["context"] for r in rows)
    at = {r["mode"]: r for r in rows if r["context"] == largest}
    result = {"machine": m, "model": model, "rows": rows,
              "speedup_shift_vs_recompute_at_largest": at["recompute"]["ttft_s"] / at["shift"]["ttft_s"]}
    name = "clear-vs-recompute" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"clearing vs recompute, {model}\n{machine_line(m)}"),
                                 args.out)
    print_table("TTFT after clearing", ["prompt", "mode", "TTFT s", "recomputed", "KL(top)", "top-1", "greedy match"],
                [[r["context"], r["mode"], r["ttft_s"], r["recomputed_tokens"], r["kl_top"], r["top1_agree"],
                  f"{r['greedy_match']}/{r['greedy_len']}"] for r in rows], machine_line(m))
    print(f"shift TTFT is {result['speedup_shift_vs_recompute_at_largest']:.2f}x lower than recompute "
          f"at {largest} tokens")
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
