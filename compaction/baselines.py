"""Baselines for comparison: sliding window and head+tail, both over atomic tool groups."""

from __future__ import annotations

from .groups import sized_groups
from .prompt import Message, PromptRenderer


def _split_system(messages: list[Message]) -> tuple[list[Message], list[Message]]:
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return messages[:n], messages[n:]


def sliding_window(messages: list[Message], renderer: PromptRenderer, max_tokens: int,
                   tools: list | None = None) -> list[Message]:
    """System messages plus the newest whole groups that fit in ``max_tokens``."""
    return head_tail(messages, renderer, max_tokens, head_ratio=0.0, tools=tools)


def head_tail(messages: list[Message], renderer: PromptRenderer, max_tokens: int,
              head_ratio: float = 0.5, tools: list | None = None) -> list[Message]:
    """System messages, the oldest groups up to ``head_ratio`` of the budget, then the newest
    groups that fit in the rest; the middle is dropped."""
    if not 0.0 <= head_ratio <= 1.0:
        raise ValueError("head_ratio must be within [0, 1]")
    system, body = _split_system(messages)
    budget = max_tokens - renderer.count(system, tools)
    sized = sized_groups(renderer, body, tools)
    head, used = [], 0
    for g, t in sized:
        if used + t > budget * head_ratio:
            break
        head.append(g)
        used += t
    tail: list[list[int]] = []
    for g, t in reversed(sized[len(head):]):
        if used + t > budget:
            break
        tail.insert(0, g)
        used += t
    keep = [i for g in head + tail for i in g]
    return system + [body[i] for i in keep]
