"""The first seed's delayed-recall session, generated from a seed: four service reports, each
hiding three facts (port, timeout, owner) among noise lines; the script is deleted; questions come
right away, after 3 and after 6 more turns of reading logs.

Sized for a small real model (SmolLM2-135M, 8192-token window), made easy enough that the model
answers most questions right after reading (measured on 4 seeds: 16/18 with 4 services x 3 facts
against 9/24 with the original 6 x 5): a fact is a sentence the answer can copy ("The
timeout_ms of the media service is 1653."), the question uses the fact's own key, the reports are
short (5 noise lines) while the logs read afterwards are long (45 lines), so the session grows
past the clearing trigger before the last questions."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

SERVICES = ("auth", "media", "billing", "search")
OWNERS = ("dana", "ravi", "mei", "oskar", "lena", "tomas", "ines", "yuki")
FACTS = ("port", "timeout_ms", "owner")
SYSTEM = ("You are an agent working in a repository. Answer questions about earlier tool outputs "
          "with the exact value. If you are not sure, say 'not sure'.")
SYSTEM_RECALL = SYSTEM + (" Earlier outputs may have been cleared from your context: call the recall "
                          "tool to search the session log instead of answering from memory.")


@dataclass(frozen=True)
class Question:
    service: str
    fact: str
    answer: str
    phase: int          # 0: right away, 1: after 3 turns, 2: after 6 more

    def text(self) -> str:
        return (f"What is the {self.fact} of the {self.service} service? "
                "Reply with the value only, or 'not sure'.")


def facts_for(rng: random.Random) -> dict[str, dict[str, str]]:
    return {svc: {"port": str(rng.randint(1024, 65535)), "timeout_ms": str(rng.randint(100, 9999)),
                  "owner": rng.choice(OWNERS)} for svc in SERVICES}


def report(rng: random.Random, service: str, facts: dict[str, str], noise_lines: int = 90) -> str:
    lines = [f"{service} probe {i}: status=ok latency_ms={rng.randint(1, 400)} "
             f"req={rng.randint(10_000, 99_999)}" for i in range(noise_lines)]
    for k, v in facts.items():
        lines.insert(rng.randrange(len(lines)), f"The {k} of the {service} service is {v}.")
    return f"== diagnostics: {service} ==\n" + "\n".join(lines)


def _call(i: int, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


@dataclass
class Scenario:
    opening: list[dict]                 # system, task, six tool uses, deletion notice
    questions: list[Question]
    reading_turns: list[list[dict]]     # tool uses between the question phases (3, then 6)

    @classmethod
    def make(cls, seed: int, recall: bool = False, noise_lines: int = 5, log_lines: int = 45) -> Scenario:
        rng = random.Random(seed)
        facts = facts_for(rng)
        msgs = [{"role": "system", "content": SYSTEM_RECALL if recall else SYSTEM},
                {"role": "user", "content": "Run python diag.py on each service and keep the results in mind."}]
        for i, svc in enumerate(SERVICES):
            msgs += [_call(i, "bash", {"cmd": f"python diag.py {svc}"}),
                     {"role": "tool", "tool_call_id": f"call_{i}",
                      "content": report(rng, svc, facts[svc], noise_lines)}]
        msgs.append({"role": "user", "content": "diag.py has been deleted; its reports exist only in this session."})
        pairs = [(s, f) for s in SERVICES for f in FACTS]
        rng.shuffle(pairs)
        questions = [Question(s, f, facts[s][f], phase) for phase in range(3)
                     for s, f in pairs[phase * 4:(phase + 1) * 4]]
        turns = []
        for t in range(9):
            n = 100 + t
            log = "\n".join(f"{rng.choice(SERVICES)} {rng.randint(0, 99999)} INFO request served"
                            for _ in range(log_lines))
            turns.append([_call(n, "read_file", {"path": f"logs/app-{t}.log"}),
                          {"role": "tool", "tool_call_id": f"call_{n}", "content": log}])
        return cls(msgs, questions, turns)


def score(answer: str, expected: str) -> str:
    """correct (the exact value is in the answer), not_sure, or invented."""
    text = (answer or "").strip().lower()
    if expected.lower() in text:
        return "correct"
    if "not sure" in text or "don't know" in text or "do not know" in text:
        return "not_sure"
    return "invented"
