"""What the KV connector costs requests that never clear: the same agent sessions sent to a server
with the connector (the default, retention: every turn's blocks are held for the next) and to one
without it (``--no-kv-retention``), same model and engine settings, A/B interleaved request by request
(the order flips every turn), streamed. Measures TTFT and decode tokens/s per request; reports the
median of the paired on/off ratios against a goal of 3%.

Starts both servers unless ``--url-on`` and ``--url-off`` are given.
Usage: ``agentkv bench connector-cost [--quick] [--model NAME] [--sessions N] [--turns N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

from .harness import RESULTS, Endpoint, machine, machine_line, print_table, pyplot, write_results

GOAL = 0.03
NO_EDITS = {"edits": []}


def tool_turn(session: int, turn: int, lines: int) -> list[dict]:
    out = "\n".join(f"probe {session}.{turn}.{j}: latency {(session * 17 + turn * 31 + j * 7) % 400} ms ok"
                    for j in range(lines))
    call = {"id": f"c{turn}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": turn})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{turn}", "content": out}]


def timed(http, model: str, msgs: list[dict], sid: str, max_tokens: int) -> dict:
    """One streamed request: time to the first token, decode tokens/s after it, prompt tokens."""
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "context_management": NO_EDITS}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with http.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid}, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and (chunk["choices"][0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    n = usage["completion_tokens"] if usage else 0
    decode = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    return {"ttft_s": (first or time.perf_counter()) - t0, "decode_tps": decode,
            "prompt_tokens": usage["prompt_tokens"] if usage else None, "completion_tokens": n}


def run(on: Endpoint, off: Endpoint, sessions: int, turns: int, lines: int, max_tokens: int) -> list[dict]:
    rows = []
    run_id = uuid.uuid4().hex[:8]
    model = on.model()["id"]
    with on.http() as h_on, off.http() as h_off:
        for s in range(sessions):
            msgs = [{"role": "system", "content": "You are an agent."},
                    {"role": "user", "content": f"Session {s}: check the services."}]
            for t in range(turns):
                msgs = msgs + tool_turn(s, t, lines)
                order = [("on", h_on), ("off", h_off)] if (s + t) % 2 == 0 else [("off", h_off), ("on", h_on)]
                for name, http in order:
                    rows.append({"connector": name, "session": s, "turn": t,
                                 **timed(http, model, msgs, f"cost-{run_id}-{s}", max_tokens)})
    return rows


def paired(rows: list[dict], key: str) -> list[float]:
    """on/off ratios of ``key`` for each (session, turn)."""
    by = {(r["session"], r["turn"], r["connector"]): r[key] for r in rows}
    return [by[(s, t, "on")] / by[(s, t, "off")] for (s, t, c) in by
            if c == "on" and by.get((s, t, "off")) and by[(s, t, "on")] is not None]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key in ("ttft_s", "decode_tps"):
        vals = {c: [r[key] for r in rows if r["connector"] == c and r[key] is not None] for c in ("on", "off")}
        ratios = paired(rows, key)
        ratio = statistics.median(ratios) if ratios else None
        # worse means a longer TTFT, or fewer decode tokens/s
        cost = (ratio - 1 if key == "ttft_s" else 1 - ratio) if ratio is not None else None
        out[key] = {"median_on": statistics.median(vals["on"]) if vals["on"] else None,
                    "median_off": statistics.median(vals["off"]) if vals["off"] else None,
                    "median_paired_ratio": ratio, "pairs": len(ratios),
                    "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else None,
                    "cost": cost, "goal_met": cost is not None and cost <= GOAL}
    return out


def plot(rows: list[dict], title: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(axes, ("ttft_s", "decode_tps"), ("TTFT (s)", "decode tokens/s")):
        for c, marker in (("on", "o"), ("off", "x")):
            rs = [r for r in rows if r["connector"] == c and r[key] is not None]
            ax.scatter([r["prompt_tokens"] for r in rs], [r[key] for r in rs], marker=marker, s=18,
                       label=f"connector {c}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench connector-cost", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 sessions x 3 turns on agentkv-tiny (smoke test)")
    ap.add_argument("--model", help="model both servers serve (default: agentkv serve's default)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="requests per session (the prompt grows each turn)")
    ap.add_argument("--tool-lines", type=int, default=30, help="lines per tool output")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per request (EOS ignored)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--url-on", help="a running server with the connector (the default: retention)")
    ap.add_argument("--url-off", help="a running server without it (--no-kv-retention)")
    ap.add_argument("--api-key", help="API key of both URLs")
    ap.add_argument("--out", default=RESULTS, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    sessions, turns = (2, 3) if args.quick else (args.sessions, args.turns)
    if sessions < 1 or turns < 1 or sessions * turns > 2000:
        ap.error("--sessions and --turns must be >= 1, with at most 2,000 pairs")
    model = "agentkv-tiny" if args.quick and not args.model else args.model
    common = ("--max-model-len", str(args.max_model_len)) + (("--model", model) if model else ())
    with Endpoint(args.url_on, args.api_key, common) as on, \
            Endpoint(args.url_off, args.api_key, common + ("--no-kv-retention",)) as off:
        served = on.model()["id"]
        rows = run(on, off, sessions, turns, args.tool_lines, args.quick and 8 or args.max_tokens)
    m = machine()
    summary = summarize(rows)
    result = {"machine": m, "model": served, "sessions": sessions, "turns": turns, "goal": GOAL,
              "summary": summary, "rows": rows}
    name = "connector-cost" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"KV connector on vs off, requests that never clear, "
                                                          f"{served}\n{machine_line(m)}"), args.out)
    print_table(f"KV connector cost ({served}, {sessions} sessions x {turns} turns, A/B interleaved)",
                ["metric", "median on", "median off", "median on/off", "cost", f"goal {GOAL:.0%}"],
                [[k, s["median_on"] or "", s["median_off"] or "", s["median_paired_ratio"] or "",
                  "" if s["cost"] is None else f"{s['cost']:+.1%}", "met" if s["goal_met"] else "not met"]
                 for k, s in summary.items()], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
