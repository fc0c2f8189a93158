"""Tool uses and atomic groups in an OpenAI message list.

A tool use is one call in an assistant message's ``tool_calls`` plus the tool message answering it.
An atomic group is an assistant message with tool calls together with its tool results: cuts and
windows keep or drop a group whole, so a call is never separated from its result.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prompt import Message, PromptRenderer


@dataclass(frozen=True)
class ToolUse:
    call_index: int          # index of the assistant message
    call_position: int       # position in its tool_calls
    result_index: int | None  # index of the tool message answering it (None: unanswered yet)
    call_id: str
    name: str
    arguments: str


def tool_uses(messages: list[Message]) -> list[ToolUse]:
    """All tool uses, oldest first."""
    answers: dict[str, int] = {}
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and m.get("tool_call_id"):
            answers.setdefault(m["tool_call_id"], i)
    uses = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function", {})
            args = fn.get("arguments", "")
            uses.append(ToolUse(i, j, answers.get(call.get("id", "")), call.get("id", ""),
                                fn.get("name", ""), args if isinstance(args, str) else str(args)))
    return uses


def groups(messages: list[Message]) -> list[list[int]]:
    """Message indices partitioned into atomic groups, in order."""
    out: list[list[int]] = []
    pending: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and out and m.get("tool_call_id") in pending:
            out[-1].append(i)
            pending.discard(m.get("tool_call_id"))
            continue
        out.append([i])
        pending = {c.get("id") for c in (m.get("tool_calls") or [])} if m.get("role") == "assistant" else set()
    return out


def sized_groups(renderer: PromptRenderer, messages: list[Message], tools=None) -> list[tuple[list[int], int]]:
    """Each atomic group with its token count in the rendered prompt."""
    bounds = [0] + renderer.char_bounds(messages, tools)
    text = renderer.render_text(messages, tools, False)
    return [(g, renderer.count_text(text[bounds[g[0]]:bounds[g[-1] + 1]])) for g in groups(messages)]
