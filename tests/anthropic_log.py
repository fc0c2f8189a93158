"""Reading Anthropic requests back from agentkv's session log (OpenAI messages)."""

from __future__ import annotations

import json


def rebuild(conv: list[dict]) -> tuple[list | str | None, list[dict]]:
    """The Anthropic request back from a logged conversation: proof that the log lost nothing."""
    system, turns = None, []
    msgs = list(conv)
    if msgs and msgs[0]["role"] == "system":  # requests here start with a user turn: this is `system`
        system = msgs.pop(0)["content"]
    for m in msgs:
        role = {"tool": "user"}.get(m["role"], m["role"])
        if m["role"] == "system":
            turns.append({"role": "system", "content": m["content"]})
            continue
        if m["role"] == "tool":
            extra = {k: v for k, v in m.items() if k not in ("role", "tool_call_id", "content")}
            blocks = [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"], **extra}]
        elif isinstance(m["content"], str):
            turns.append({"role": role, "content": m["content"]})
            continue
        else:
            blocks = list(m["content"] or []) + [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or []]
        if turns and turns[-1]["role"] == role and isinstance(turns[-1]["content"], list):
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def strip_cache(x):
    if isinstance(x, dict):
        return {k: strip_cache(v) for k, v in x.items() if k != "cache_control"}
    if isinstance(x, list):
        return [strip_cache(v) for v in x]
    return x
