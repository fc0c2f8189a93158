"""Thinking clearing (Anthropic `clear_thinking_20251015`): the reasoning of older assistant turns
leaves the prompt.

In OpenAI messages an assistant turn's reasoning is its ``reasoning`` field (vLLM's name;
``reasoning_content`` is the older one), which the chat templates of reasoning models render. Under
a template that does not render it, clearing frees no tokens; it is still reported, since the
engine no longer receives that reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .prompt import Message, PromptRenderer

if TYPE_CHECKING:
    from .edit_kinds.clear_thinking import ClearThinking

REASONING_KEYS = ("reasoning", "reasoning_content")


@dataclass
class ThinkingResult:
    messages: list[Message]
    cleared_turns: int = 0
    tokens_before: int = 0
    tokens_after: int = 0

    @property
    def cleared_tokens(self) -> int:
        return self.tokens_before - self.tokens_after


def has_thinking(message: Message) -> bool:
    return message.get("role") == "assistant" and any(message.get(k) for k in REASONING_KEYS)


def clear_thinking(messages: list[Message], renderer: PromptRenderer, cfg: ClearThinking,
                   tools: list | None = None) -> ThinkingResult:
    """Remove the reasoning of every assistant turn with some, but the newest ``cfg.keep``."""
    turns = [i for i, m in enumerate(messages) if has_thinking(m)]
    if cfg.keep == "all" or len(turns) <= cfg.keep:
        return ThinkingResult(messages)
    drop = set(turns[:len(turns) - cfg.keep])
    new = [{k: v for k, v in m.items() if k not in REASONING_KEYS} if i in drop else m
           for i, m in enumerate(messages)]
    return ThinkingResult(new, len(drop), renderer.count(messages, tools), renderer.count(new, tools))
