"""Delayed recall (the first seed's test): are facts from tool outputs still answerable after
the context was cleared or summarized? Scored by exact match: correct / invented / not sure.

Usage: ``agentkv bench delayed-recall [--quick] [--seeds N] [--window TOKENS] [--url URL]``.
"""

from __future__ import annotations

import argparse
import uuid
from collections import Counter

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, write_results, pyplot
from .scenario import Scenario, score

OUTCOMES = ("correct", "invented", "not_sure")


def setups(window: int) -> dict[str, dict]:
    """context_management per setup, with triggers as fractions of a simulated window."""
    clear = {"type": "clear_tool_uses", "trigger": window // 2, "keep": 3, "clear_at_least": window // 10}
    return {
        "no compaction": {"edits": []},
        "clearing": {"edits": [clear]},
        "clearing + summary": {"edits": [clear, {"type": "compact", "trigger": window * 3 // 4,
                                                 "keep_recent_tokens": window * 3 // 10}]},
        "aggressive": {"edits": [{"type": "compact", "trigger": window * 3 // 10,
                                  "keep_recent_tokens": window // 10}]},
    }


def run_one(http, model: str, scenario: Scenario, policy: dict, recall: bool, max_tokens: int) -> list[dict]:
    msgs, sid, out = list(scenario.opening), f"bench-{uuid.uuid4().hex[:12]}", []
    turns = iter(scenario.reading_turns)
    for phase, n_turns in ((0, 0), (1, 3), (2, 6)):
        for _ in range(n_turns):
            msgs += next(turns)
        for q in [q for q in scenario.questions if q.phase == phase]:
            msgs.append({"role": "user", "content": q.text()})
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                "model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "context_management": policy, "server_tools": recall})
            r.raise_for_status()
            body = r.json()
            answer = body["choices"][0]["message"].get("content") or ""
            msgs.append({"role": "assistant", "content": answer})
            out.append({"phase": phase, "service": q.service, "fact": q.fact, "expected": q.answer,
                        "answer": answer, "outcome": score(answer, q.answer),
                        "prompt_tokens": body["usage"]["prompt_tokens"],
                        "recall_calls": len(body.get("server_tool_calls") or [])})
    return out


def summarize_runs(runs: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["setup"] for r in runs):
        for recall in (False, True):
            answers = [a for r in runs if r["setup"] == name and r["recall"] == recall for a in r["answers"]]
            if not answers:
                continue
            c = Counter(a["outcome"] for a in answers)
            by_phase = {p: sum(a["outcome"] == "correct" for a in answers if a["phase"] == p) for p in range(3)}
            rows.append({"setup": name, "recall": recall, **{o: c.get(o, 0) for o in OUTCOMES},
                         "answers": len(answers), "correct_by_phase": by_phase,
                         "mean_prompt_tokens": sum(a["prompt_tokens"] for a in answers) / len(answers)})
    return rows


def plot(rows: list[dict], title: str):
    plt = pyplot()

    labels = [f"{r['setup']}{' + recall' if r['recall'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    left = [0] * len(rows)
    for outcome, color in zip(OUTCOMES, ("tab:green", "tab:red", "tab:gray")):
        vals = [r[outcome] for r in rows]
        ax.barh(labels, vals, left=left, color=color, label=outcome)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("answers")
    ax.legend()
    ax.set_title(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench delayed-recall", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 setups, short reports (smoke test)")
    ap.add_argument("--seeds", type=int, default=2, help="runs per setup (default: 2)")
    ap.add_argument("--window", type=int, default=16384, help="simulated context window for the triggers")
    ap.add_argument("--max-tokens", type=int, default=12, help="answer length limit")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    seeds, noise = (1, 20) if args.quick else (args.seeds, 90)
    chosen = setups(args.window if not args.quick else 2048)
    if args.quick:
        chosen = {k: chosen[k] for k in ("no compaction", "clearing")}
    from tqdm import tqdm

    runs = []
    with Endpoint(args.url, args.api_key) as ep, ep.http() as http:
        model = ep.model()["id"]
        jobs = [(n, p, rc, s) for n, p in chosen.items() for rc in (False, True) for s in range(seeds)]
        for name, policy, recall, seed in tqdm(jobs, desc="delayed recall"):
            scenario = Scenario.make(seed, recall, noise)
            runs.append({"setup": name, "recall": recall, "seed": seed,
                         "answers": run_one(http, model, scenario, policy, recall, args.max_tokens)})
    rows = summarize_runs(runs)
    m = machine()
    result = {"machine": m, "model": model, "window": args.window, "seeds": seeds, "rows": rows, "runs": runs}
    name = "delayed-recall" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"delayed recall, {model}\n{machine_line(m)}"), args.out)
    print_table(f"delayed recall ({model})", ["setup", "recall", *OUTCOMES, "mean prompt tokens"],
                [[r["setup"], r["recall"], *[r[o] for o in OUTCOMES], r["mean_prompt_tokens"]] for r in rows],
                machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
