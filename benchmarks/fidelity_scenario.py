"""The fidelity benchmark's conversations, questions and scoring (seeded, no engine).

An agent reads services' diagnostics (``diagnose``, cleared later) and configs (``read_config``,
kept: excluded from clearing), alternately, so clearing cuts the conversation in many places and
kept results follow every cut. Each tool result states five facts in sentences among noise lines.
After clearing, every fact is asked about: facts of kept results (``near`` a cut: within
``NEAR`` tokens after it; or ``far``) and facts only the cleared results held (``ghost``: an
answer from recompute is a guess; a right answer from moved K/V is what stale K/V remembered).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

SERVICES = ("auth", "billing", "media", "search", "gateway", "ledger", "mailer", "cache", "scheduler",
            "indexer", "router", "vault", "metrics", "uploads")
OWNERS = ("alice", "bruno", "chen", "dana", "emil", "farah", "goran", "hana", "ivan", "jun")
REGIONS = ("oslo", "lima", "pune", "cairo", "quito", "perth", "riga", "dakar")
KEPT_TOOL, CLEARED_TOOL = "read_config", "diagnose"
NEAR = 256
CLEAR = {"type": "clear_tool_uses", "trigger": 0, "keep": 0, "exclude_tools": [KEPT_TOOL]}
SYSTEM = "You are an agent. Answer the user's questions about the tool results in one sentence."


@dataclass(frozen=True)
class Question:
    service: str
    fact: str
    answer: str
    kept: bool             # the fact's tool result survives clearing
    text: str


def facts_of(rng: random.Random) -> dict[str, str]:
    return {"port": str(rng.randint(1024, 65535)), "timeout_ms": str(rng.randint(100, 9999)),
            "owner": rng.choice(OWNERS), "region": rng.choice(REGIONS), "build": str(rng.randint(100000, 999999))}


def result_text(rng: random.Random, tool: str, service: str, facts: dict[str, str], noise: int) -> str:
    lines = [f"{service} probe {i}: status=ok latency_ms={rng.randint(1, 400)} req={rng.randint(10_000, 99_999)}"
             for i in range(noise)]
    for k, v in facts.items():
        lines.insert(rng.randrange(len(lines) + 1), f"The {k} of the {service} service is {v}.")
    title = "diagnostics" if tool == CLEARED_TOOL else "config"
    return f"== {title}: {service} ==\n" + "\n".join(lines)


def conversation(seed: int, uses: int, noise: int = 20) -> tuple[list[dict], list[Question]]:
    """``uses`` tool uses alternating diagnose / read_config, one service each; every fact asked."""
    if uses > len(SERVICES):
        raise ValueError(f"at most {len(SERVICES)} tool uses")
    rng = random.Random(seed * 1000 + uses)
    services = rng.sample(SERVICES, uses)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Check the services, then answer."}]
    questions = []
    for i, svc in enumerate(services):
        tool = CLEARED_TOOL if i % 2 == 0 else KEPT_TOOL
        facts = facts_of(rng)
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{i}", "type": "function",
                      "function": {"name": tool, "arguments": json.dumps({"service": svc})}}]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": result_text(rng, tool, svc, facts, noise)}]
        questions += [Question(svc, k, v, tool == KEPT_TOOL, f"What is the {k} of the {svc} service?")
                      for k, v in facts.items()]
    rng.shuffle(questions)
    return msgs, questions


def ask(msgs: list[dict], q: Question) -> list[dict]:
    return msgs + [{"role": "user", "content": q.text}]


_VALUE = re.compile(r"\bis\s+([A-Za-z0-9_\-]+)")


def extract(answer: str) -> str:
    """The value an answer states: the word after the first "is", else its first word."""
    m = _VALUE.search(answer)
    if m:
        return m.group(1)
    words = re.findall(r"[A-Za-z0-9_\-]+", answer)
    return words[0] if words else ""


def correct(answer: str, q: Question) -> bool:
    """Exact match of the stated value (case-insensitive)."""
    return extract(answer).lower() == q.answer.lower()


def distance_after_cut(renderer, edited: list[dict], cleared: set[int], q: Question) -> int | None:
    """Tokens from the end of the nearest cleared result before the fact to the fact (kept facts only)."""
    if not q.kept:
        return None
    rendered = renderer.render(edited)
    i = next(i for i, m in enumerate(edited) if m.get("role") == "tool" and f": {q.service} ==" in (m["content"] or ""))
    before = [j for j in cleared if j < i]
    cut_end = rendered.ranges[max(before)][1] if before else rendered.ranges[1][1]
    content = edited[i]["content"]
    offset = len(renderer.tokenizer.encode(content[:content.index(f"The {q.fact} of")], add_special_tokens=False))
    return rendered.ranges[i][0] - cut_end + offset
