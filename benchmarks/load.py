"""Load: N concurrent agent sessions, each a tool loop whose context grows until clearing fires.

Every turn sends the whole conversation (as an agent harness does) with the session's
``X-Session-Id``; the client plays the tools: after each model reply it appends a tool call and a
tool output of ``--tool-lines`` lines. Reports requests/s, latency p50/p99, errors (should be 0),
how many requests had clearing applied, and whether every session's log on the server is
complete afterwards (``GET /v1/sessions/{id}/messages`` equals what the client sent).
``--kv-reuse shift|blend`` asks for KV reuse after clearing on every request (the server must run
with the KV connector: one is started with ``--kv-reuse shift`` when no ``--url`` is given) and
reports what the connector did with each edit: tokens reused, fallbacks to recompute by reason.
Loopback only, bounded by ``--sessions`` x ``--turns``.
Usage: ``agentkv bench load [--quick] [--kv-reuse MODE] [--url URL --api-key KEY]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid

import numpy as np

from agentkv.server.kv_modes import kv_mode
from agentkv.server.options import KV_MODES

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
WORDS = "ok check latency service retry queue shard node disk cache write read index commit".split()


def tool_output(rng: random.Random, turn: int, lines: int) -> str:
    out = [f"{rng.choice(WORDS)} {rng.choice(WORDS)} {rng.randrange(10_000)} ms" for _ in range(lines)]
    out.insert(lines // 2, f"fact {turn}: value = {rng.randrange(10**6)}")
    return "\n".join(out)


async def run_session(client, model: str, sid: str, turns: int, lines: int, max_tokens: int, seed: int,
                      kv_reuse: str) -> dict:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are an agent. Use bash to inspect the services."},
                {"role": "user", "content": f"Session {sid}: find the slow service."}]
    rec = {"session": sid, "latencies": [], "prompt_tokens": [], "cached_tokens": [], "errors": [], "cleared": 0,
           "sent": None, "kv": []}
    for turn in range(turns):
        t0 = time.perf_counter()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0,
                extra_headers={"X-Session-Id": sid}, extra_body={"kv_reuse": kv_reuse})
            reply = raw.parse()
        except Exception as exc:  # counted, reported, and the session stops (its log is still checked)
            rec["errors"].append(f"turn {turn}: {exc.__class__.__name__}: {exc}"[:300])
            break
        rec["latencies"].append(time.perf_counter() - t0)
        rec["prompt_tokens"].append(reply.usage.prompt_tokens if reply.usage else 0)
        details = reply.usage.prompt_tokens_details if reply.usage else None
        rec["cached_tokens"].append((details.cached_tokens or 0) if details else 0)
        report = (reply.model_extra or {}).get("context_management") or {}
        rec["cleared"] += bool(report.get("applied_edits"))
        rec["kv"] += [e["kv"] for e in report.get("applied_edits", []) if "kv" in e][:1]
        rec["sent"] = list(messages)
        call_id = f"call_{turn}"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or None,
                         "tool_calls": [{"id": call_id, "type": "function", "function": {
                             "name": "bash", "arguments": json.dumps({"cmd": f"diag --service s{turn}"})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_output(rng, turn, lines)})
    return rec


async def check_log(http, rec: dict) -> bool:
    """The server's log of the session holds exactly the messages the client sent, in order."""
    if rec["sent"] is None:
        return True
    got, offset = [], 0
    while True:
        r = await http.get(f"/v1/sessions/{rec['session']}/messages", params={"offset": offset})
        if r.status_code != 200:
            return False
        page = r.json()
        got += page["data"]
        offset += len(page["data"])
        if not page["has_more"]:
            break
    return got == json.loads(json.dumps(rec["sent"]))


async def measure(url: str, api_key: str | None, model: str, sessions: int, turns: int, lines: int,
                  max_tokens: int, kv_reuse: str = "recompute") -> dict:
    import httpx
    from openai import AsyncOpenAI

    run = uuid.uuid4().hex[:8]
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(run_session(client, model, f"load-{run}-{i}", turns, lines, max_tokens, i, kv_reuse)
                                  for i in range(sessions)))
    wall = time.perf_counter() - t0
    await client.close()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        complete = [await check_log(http, r) for r in recs]
    lat = np.array([x for r in recs for x in r["latencies"]])
    hit_rates = [hit_rate(r) for r in recs]
    kv = [k for r in recs for k in r["kv"]]
    fallbacks: dict[str, int] = {}
    for k in kv:
        if k.get("fallback"):
            fallbacks[k["fallback"]] = fallbacks.get(k["fallback"], 0) + 1
    reusable = len(kv) - fallbacks.get("too_short", 0)
    reused = sum(1 for k in kv if k.get("reused_tokens"))
    return {"sessions": sessions, "turns": turns, "tool_lines": lines, "max_tokens": max_tokens, "kv_reuse": kv_reuse,
            "kv_edits": len(kv), "kv_reused_tokens": sum(k.get("reused_tokens", 0) for k in kv),
            "kv_fallbacks": fallbacks, "kv_edits_reusable": reusable, "kv_edits_reused": reused,
            "kv_reused_share": reused / reusable if reusable else None,
            "requests": int(lat.size), "errors": sum(len(r["errors"]) for r in recs),
            "error_messages": [e for r in recs for e in r["errors"]][:20], "wall_s": wall,
            "requests_per_s": lat.size / wall if wall else 0.0,
            "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else None,
            "requests_with_clearing": sum(r["cleared"] for r in recs),
            "session_hit_rates": hit_rates, "hit_rate_mean": float(np.mean(hit_rates)) if hit_rates else None,
            "hit_rate_min": min(hit_rates, default=None),
            "logs_complete": sum(complete),
            "max_prompt_tokens": max((max(r["prompt_tokens"], default=0) for r in recs)),
            "latencies_s": lat.tolist(),
            "per_turn": [{"prompt_tokens": p, "latency_s": x}
                         for r in recs for p, x in zip(r["prompt_tokens"], r["latencies"])]}


def host_tier_metrics(ep: Endpoint) -> dict[str, float]:
    """The server's host-tier counters (``vllm:agentkv_kv_*``, docs/kv-reuse.md), with bytes and
    milliseconds per restore; empty when the server has no connector."""
    import httpx

    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
    text = httpx.get(f"{ep.url}/metrics", headers=headers, timeout=30).text
    names = ("spilled_blocks", "restored_blocks", "dropped_blocks", "restores", "restore_bytes", "restore_seconds")
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(f"vllm:agentkv_kv_{name}_total"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if out.get("restores"):
        out["bytes_per_restore"] = out.get("restore_bytes", 0.0) / out["restores"]
        out["ms_per_restore"] = 1000 * out.get("restore_seconds", 0.0) / out["restores"]
    return out


def hit_rate(rec: dict) -> float:
    """A session's prefix-cache hit rate after its first turn: the share of its prompt tokens whose
    K/V the engine had (prefix cache or KV connector) on turns 2..n."""
    prompt, cached = sum(rec["prompt_tokens"][1:]), sum(rec["cached_tokens"][1:])
    return cached / prompt if prompt else 0.0


def plot(res: dict, title: str):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = np.sort(np.array(res["latencies_s"]))
    a.plot(lat, np.arange(1, lat.size + 1) / max(lat.size, 1))
    a.set_xlabel("request latency (s)")
    a.set_ylabel("fraction of requests")
    b.scatter([t["prompt_tokens"] for t in res["per_turn"]], [t["latency_s"] for t in res["per_turn"]], s=10)
    b.set_xlabel("prompt tokens the engine saw")
    b.set_ylabel("latency (s)")
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench load", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4 sessions x 5 turns (smoke test)")
    ap.add_argument("--sessions", type=int, default=16, help="concurrent agent sessions")
    ap.add_argument("--turns", type=int, default=10, help="requests per session")
    ap.add_argument("--tool-lines", type=int, default=30, help="lines per tool output")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--kv-reuse", choices=KV_MODES, default="recompute",
                    help="KV reuse asked for after clearing (shift/blend need the server's KV connector)")
    ap.add_argument("--kv-offload-gib", type=float, default=None,
                    help="the started server's host tier for held K/V (0: none; default: the server's default); "
                         "results of a run without it are named ...-no-tier")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    sessions, turns = (4, 5) if args.quick else (args.sessions, args.turns)
    if sessions < 1 or turns < 1 or sessions * turns > 10_000:
        ap.error("--sessions and --turns must be >= 1, with at most 10,000 requests in all")
    # a 2k window when we start the server: clearing fires within a few turns
    serve = ("--max-model-len", "2048") + (("--kv-reuse", "shift") if kv_mode(args.kv_reuse).uses_connector else ())
    if args.kv_offload_gib is not None:
        if args.url:
            ap.error("--kv-offload-gib configures the server this benchmark starts; not with --url")
        serve += ("--kv-offload-gib", str(args.kv_offload_gib))
    with Endpoint(args.url, args.api_key, serve_args=serve) as ep:
        model = ep.model()["id"]
        res = asyncio.run(measure(ep.url, ep.api_key, model, sessions, turns, args.tool_lines, args.max_tokens,
                                  args.kv_reuse))
        res["host_tier"] = host_tier_metrics(ep)
    m = machine()
    result = {"machine": m, "model": model, "kv_offload_gib": args.kv_offload_gib, **res}
    name = ("load" + (f"-{args.kv_reuse}" if args.kv_reuse != "recompute" else "")
            + ("-no-tier" if args.kv_offload_gib == 0 else "") + ("-quick" if args.quick else ""))
    fig = plot(res, f"load: {sessions} sessions x {turns} turns, kv_reuse {args.kv_reuse}, {model}\n{machine_line(m)}")
    jpath, ppath = write_results(name, result, fig, args.out)
    print_table(f"load ({model}, {sessions} sessions x {turns} turns, kv_reuse {args.kv_reuse})",
                ["requests", "errors", "req/s", "p50 s", "p99 s", "with clearing", "logs complete", "hit rate mean",
                 "hit rate min", "edits reused", "KV reused", "KV fallbacks", "host tier"],
                [[res["requests"], res["errors"], res["requests_per_s"], res["latency_p50_s"] or "",
                  res["latency_p99_s"] or "", res["requests_with_clearing"], f"{res['logs_complete']}/{sessions}",
                  res["hit_rate_mean"] or 0.0, res["hit_rate_min"] or 0.0,
                  f"{res['kv_edits_reused']}/{res['kv_edits_reusable']}", res["kv_reused_tokens"],
                  json.dumps(res["kv_fallbacks"]), json.dumps(res["host_tier"])]],
                machine_line(m))
    for e in res["error_messages"]:
        print("error:", e)
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
