"""Delayed recall (the first seed's test): are facts from tool outputs still answerable after
the context was cleared or summarized? Scored by exact match: correct / invented / not sure.

Usage: ``agentkv bench delayed-recall [--quick] [--seeds N] [--window TOKENS] [--url URL]``.
The policies' triggers are fractions of the served model's window (or ``--window``); a question
whose prompt no longer fits the window is scored ``overflow`` (the session cannot go on without
compaction) instead of failing the run.
"""

from __future__ import annotations

import argparse
import uuid
from collections import Counter

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results
from .scenario import Scenario, score

OUTCOMES = ("correct", "invented", "not_sure", "overflow")


def setups(window: int) -> dict[str, dict | None]:
    """context_management per setup, with triggers as fractions of a simulated window; ``server
    default`` sends none, so the server's own default policy runs (on the served window)."""
    clear = {"type": "clear_tool_uses", "trigger": window // 2, "keep": 3, "clear_at_least": window // 10}
    return {
        "no compaction": {"edits": []},
        "server default": None,
        "clearing": {"edits": [clear]},
        "clearing + summary": {"edits": [clear, {"type": "compact", "trigger": window * 3 // 4,
                                                 "keep_recent_tokens": window * 3 // 10}]},
        "aggressive": {"edits": [{"type": "compact", "trigger": window * 3 // 10,
                                  "keep_recent_tokens": window // 10}]},
    }


def run_one(http, model: str, scenario: Scenario, policy: dict, recall: bool, max_tokens: int) -> list[dict]:
    """One session: each question is asked on top of the work so far, and its answer is not kept
    (the quiz is not part of the work: a wrong answer must not prime the next one)."""
    msgs, sid, out = list(scenario.opening), f"bench-{uuid.uuid4().hex[:12]}", []
    turns = iter(scenario.reading_turns)
    for phase, n_turns in ((0, 0), (1, 3), (2, 6)):
        for _ in range(n_turns):
            msgs += next(turns)
        for q in [q for q in scenario.questions if q.phase == phase]:
            body = {"model": model, "messages": msgs + [{"role": "user", "content": q.text()}],
                    "max_tokens": max_tokens, "temperature": 0, "server_tools": recall}
            if policy is not None:
                body["context_management"] = policy
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=body)
            row = {"phase": phase, "service": q.service, "fact": q.fact, "expected": q.answer}
            if r.status_code == 400 and "context" in r.text.lower():   # the prompt outgrew the window
                out.append({**row, "answer": None, "outcome": "overflow", "prompt_tokens": None,
                            "recall_calls": 0, "error": r.json()["error"]["message"][:300]})
                continue
            r.raise_for_status()
            body = r.json()
            answer = body["choices"][0]["message"].get("content") or ""
            applied = [e["type"] for e in body["context_management"]["applied_edits"]]
            out.append({**row, "answer": answer, "outcome": score(answer, q.answer),
                        "prompt_tokens": body["usage"]["prompt_tokens"], "applied_edits": applied,
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
            asked = {p: sum(a["phase"] == p for a in answers) for p in range(3)}
            fitted = [a["prompt_tokens"] for a in answers if a["prompt_tokens"] is not None]
            fired = Counter(t for r in runs if r["setup"] == name and r["recall"] == recall
                            for t in {e for a in r["answers"] for e in a.get("applied_edits", [])})
            rows.append({"setup": name, "recall": recall, **{o: c.get(o, 0) for o in OUTCOMES},
                         "answers": len(answers), "correct_by_phase": by_phase, "asked_by_phase": asked,
                         "runs_where_edit_fired": dict(fired),
                         "mean_prompt_tokens": sum(fitted) / len(fitted) if fitted else None})
    return rows


def plot(rows: list[dict], title: str):
    plt = pyplot()

    labels = [f"{r['setup']}{' + recall' if r['recall'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    left = [0] * len(rows)
    for outcome, color in zip(OUTCOMES, ("tab:green", "tab:red", "tab:gray", "black")):
        vals = [r[outcome] for r in rows]
        ax.barh(labels, vals, left=left, color=color, label=outcome)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("answers")
    ax.legend()
    ax.set_title(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench delayed-recall", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 setups, short logs (smoke test)")
    ap.add_argument("--seeds", type=int, default=2, help="runs per setup (default: 2)")
    ap.add_argument("--window", type=int, help="context window the triggers are fractions of "
                                                   "(default: the served model's)")
    ap.add_argument("--report-lines", type=int, default=5, help="noise lines per service report (default: 5)")
    ap.add_argument("--log-lines", type=int, default=45, help="lines per log read between questions (default: 45)")
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length limit")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    for flag in ("seeds", "report_lines", "log_lines", "max_tokens", "window"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    seeds, log_lines = (1, 10) if args.quick else (args.seeds, args.log_lines)
    from tqdm import tqdm

    runs = []
    with Endpoint(args.url, args.api_key) as ep, ep.http() as http:
        served = ep.model()
        model = served["id"]
        window = 2048 if args.quick else args.window or served["max_model_len"]
        chosen = setups(window)
        if args.quick:
            chosen = {k: chosen[k] for k in ("no compaction", "clearing")}
        jobs = [(n, p, rc, s) for n, p in chosen.items() for rc in (False, True) for s in range(seeds)]
        for name, policy, recall, seed in tqdm(jobs, desc="delayed recall"):
            scenario = Scenario.make(seed, recall, args.report_lines, log_lines)
            runs.append({"setup": name, "recall": recall, "seed": seed,
                         "answers": run_one(http, model, scenario, policy, recall, args.max_tokens)})
    rows = summarize_runs(runs)
    m = machine()
    result = {"machine": m, "model": model, "window": window, "seeds": seeds, "report_lines": args.report_lines,
              "log_lines": log_lines, "max_tokens": args.max_tokens, "rows": rows, "runs": runs}
    name = "delayed-recall" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"delayed recall, {model}\n{machine_line(m)}"), args.out)
    print_table(f"delayed recall ({model}, window {window})",
                ["setup", "recall", *OUTCOMES, "correct by phase", "edits fired (runs)", "mean prompt tokens"],
                [[r["setup"], r["recall"], *[r[o] for o in OUTCOMES],
                  " / ".join(f"{r['correct_by_phase'][p]}/{r['asked_by_phase'][p]}" for p in range(3)),
                  ", ".join(f"{k} {v}" for k, v in r["runs_where_edit_fired"].items()) or "none",
                  r["mean_prompt_tokens"]] for r in rows], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
