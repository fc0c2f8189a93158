"""Summary probe (the second seed's test): documents with planted headline and obscure facts are
read, the session is compacted with the default and with guided instructions, and each fact is
asked from the summary alone. Per fact: kept in the summary text, and answered correctly. The
baseline (``full documents``) asks the same questions with the documents themselves in context:
what the model can answer at all, which the summaries are measured against.

Usage: ``agentkv bench probe [--quick] [--url URL]``.
"""

from __future__ import annotations

import argparse
import json
import random

from agentkv.compaction.config import Compact
from agentkv.compaction.prompt import PromptRenderer
from agentkv.compaction.summarize import OpenAIModelClient, summarize

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results
from .scenario import score

GUIDED = ("Write a handoff note. Preserve every number, name, date, time, identifier and threshold "
          "from the documents exactly as written; list them under 'Facts'.")
TOPICS = ("billing migration", "auth outage", "search reindex", "storage quota", "media pipeline", "queue backlog")


def documents(seed: int, n: int, filler: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        headline = ("budget", f"{rng.randint(10, 99)}k EUR")
        obscure = ("backup window", f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC")
        body = [f"{topic.title()} report. The {headline[0]} for the {topic} is {headline[1]}."]
        body += [f"Paragraph {j}: the team reviewed the {topic} plan and agreed to continue." for j in range(filler)]
        body.insert(rng.randrange(2, len(body)), f"Note: the {obscure[0]} for {topic} is {obscure[1]}.")
        docs.append({"topic": topic, "text": "\n".join(body),
                     "facts": [{"kind": "headline", "name": headline[0], "value": headline[1]},
                               {"kind": "obscure", "name": obscure[0], "value": obscure[1]}]})
    return docs


def session(docs: list[dict]) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an analyst agent."},
            {"role": "user", "content": "Read the project documents."}]
    for i, d in enumerate(docs):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"doc_{i}", "type": "function",
                      "function": {"name": "read_file", "arguments": json.dumps({"path": f"docs/{i}.md"})}}]},
                 {"role": "tool", "tool_call_id": f"doc_{i}", "content": d["text"]}]
    return msgs + [{"role": "user", "content": "Thanks. We will come back to these later."}]


def probe(client, model: str, renderer: PromptRenderer, docs: list[dict], instructions: str | None,
          max_tokens: int, baseline: bool = False) -> list[dict]:
    """Ask every fact from the summary (or, ``baseline``, from the whole session)."""
    if baseline:
        context, summary = session(docs), None
    else:
        r = summarize(session(docs), renderer, Compact(trigger=0, keep_recent_tokens=0,
                                                       summary_max_tokens=max_tokens, instructions=instructions),
                      OpenAIModelClient(client, model))
        summary = r.messages[1]["content"]
        context = [r.messages[0], {"role": "user", "content": summary}]
    out = []
    for d in docs:
        for f in d["facts"]:
            q = f"What is the {f['name']} for the {d['topic']}? Reply with the value only, or 'not sure'."
            ans = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                                 messages=context + [{"role": "user", "content": q}])
            text = ans.choices[0].message.content or ""
            out.append({"topic": d["topic"], "kind": f["kind"], "fact": f["name"], "expected": f["value"],
                        "kept_in_summary": f["value"] in summary if summary is not None else None,
                        "answer": text, "outcome": score(text, f["value"])})
    return out


def plot(rows: list[dict], title: str):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['instructions']} / {r['kind']}" for r in rows]
    ax.bar(labels, [r["kept"] for r in rows], label="kept in summary")
    ax.bar(labels, [r["correct"] for r in rows], width=0.4, label="answered correctly")
    ax.set_ylabel("facts")
    ax.legend()
    ax.set_title(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench probe", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two short documents (smoke test)")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary-tokens", type=int, default=512)
    ap.add_argument("--tokenizer", help="tokenizer path or id (default: the served model's path)")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    n, filler, note_tokens = (2, 4, 32) if args.quick else (args.docs, 30, args.summary_tokens)
    from openai import OpenAI

    with Endpoint(args.url, args.api_key) as ep:
        info = ep.model()
        model = info["id"]
        renderer = PromptRenderer.from_pretrained(args.tokenizer or info.get("root") or model)
        client = OpenAI(base_url=f"{ep.url}/v1", api_key=ep.api_key or "none", max_retries=0, timeout=900)
        docs = documents(args.seed, n, filler)
        facts = {"full documents": probe(client, model, renderer, docs, None, note_tokens, baseline=True)}
        facts |= {name: probe(client, model, renderer, docs, instr, note_tokens)
                  for name, instr in (("default", None), ("guided", GUIDED))}
    rows = [{"instructions": name, "kind": kind, "facts": len(fs),
             "kept": sum(bool(f["kept_in_summary"]) for f in fs) if name != "full documents" else len(fs),
             "correct": sum(f["outcome"] == "correct" for f in fs)}
            for name, all_facts in facts.items() for kind in ("headline", "obscure")
            for fs in [[f for f in all_facts if f["kind"] == kind]]]
    m = machine()
    result = {"machine": m, "model": model, "rows": rows, "facts": facts}
    name = "probe" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"summary probe, {model}\n{machine_line(m)}"), args.out)
    print_table(f"summary probe ({model})", ["instructions", "kind", "facts", "kept", "correct"],
                [[r["instructions"], r["kind"], r["facts"], r["kept"], r["correct"]] for r in rows], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
