"""Hypothesis strategies for tool-heavy agent conversations (OpenAI message lists)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

TOOL_NAMES = ["bash", "read_file", "grep", "write_file"]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in TOOL_NAMES]
WORDS = st.sampled_from("alpha beta gamma port timeout region owner error E2033 1050 media auth "
                        "retry config service line value".split())


def _text(draw, lo: int, hi: int) -> str:
    return " ".join(draw(st.lists(WORDS, min_size=lo, max_size=hi)))


@st.composite
def conversations(draw, max_turns: int = 8):
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": _text(draw, 3, 12)}]
    n_call = 0
    for _ in range(draw(st.integers(1, max_turns))):
        kind = draw(st.sampled_from(["tools", "tools", "text", "user"]))
        if kind == "tools":
            calls = []
            for _ in range(draw(st.integers(1, 2))):
                n_call += 1
                name = draw(st.sampled_from(TOOL_NAMES))
                args = json.dumps({"path": f"src/{draw(WORDS)}.py"})
                calls.append({"id": f"call_{n_call}", "type": "function",
                              "function": {"name": name, "arguments": args}})
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                lines = [_text(draw, 2, 10) for _ in range(draw(st.integers(0, 30)))]
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": "\n".join(lines)})
        elif kind == "text":
            msgs.append({"role": "assistant", "content": _text(draw, 1, 15)})
        else:
            msgs.append({"role": "user", "content": _text(draw, 1, 15)})
    return msgs
