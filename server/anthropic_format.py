"""Anthropic Messages <-> OpenAI chat messages, so one context manager serves both APIs.

Supported blocks: text, tool_use, tool_result (text content). A user turn's tool results become
tool messages (then its text a user message); an assistant turn's tool uses become tool_calls.
The reverse mapping merges them back, tool results first, as Anthropic requires.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import APIError

SUPPORTED = {"text", "tool_use", "tool_result"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


def to_openai(system: Any, messages: list[dict]) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": _text(system)}] if system else []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        for j, b in enumerate(content or []):
            if b.get("type") not in SUPPORTED:
                raise APIError(400, f"content block type {b.get('type')!r} is not supported with context "
                                    f"management (supported: {sorted(SUPPORTED)})", param=f"messages.{i}.content.{j}")
        texts = "".join(b["text"] for b in content if b["type"] == "text")
        if m["role"] == "assistant":
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}}
                     for b in content if b["type"] == "tool_use"]
            msg: dict = {"role": "assistant", "content": texts or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in content:
            if b["type"] == "tool_result":
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))})
        if texts:
            out.append({"role": "user", "content": texts})
    return out


def to_anthropic(messages: list[dict]) -> tuple[str | None, list[dict]]:
    system = "\n\n".join(_text(m["content"]) for m in messages if m["role"] in ("system", "developer")) or None
    out: list[dict] = []

    def user_blocks() -> list:
        if not out or out[-1]["role"] != "user":
            out.append({"role": "user", "content": []})
        return out[-1]["content"]

    for m in messages:
        role = m["role"]
        if role in ("system", "developer"):
            continue
        if role == "tool":
            user_blocks().append({"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                  "content": _text(m.get("content"))})
        elif role == "user":
            user_blocks().append({"type": "text", "text": _text(m.get("content"))})
        else:
            blocks: list[dict] = [{"type": "text", "text": _text(m["content"])}] if _text(m.get("content")) else []
            for c in m.get("tool_calls") or []:
                args = c["function"].get("arguments") or "{}"
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(args) if isinstance(args, str) else args})
            if out and out[-1]["role"] == "assistant":   # Anthropic turns alternate: merge
                out[-1]["content"] += blocks
            else:
                out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
    return system, out


def tools_to_openai(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                              "parameters": t.get("input_schema") or {"type": "object"}}}
            for t in tools]
