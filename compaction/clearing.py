"""Tool-result clearing (Anthropic `clear_tool_uses_20250919` semantics) with exact prompt edits."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .edits import PromptEdit, diff_edits
from .groups import ToolUse, tool_uses
from .prompt import Message, PromptRenderer
from .prompt import content_text as _text

if TYPE_CHECKING:
    from .edit_kinds.clear_tool_uses import ClearToolUses

CLEARED = "[cleared tool result]"
MAX_ARGS_CHARS = 200


@dataclass
class ClearResult:
    messages: list[Message]
    edits: list[PromptEdit] = field(default_factory=list)
    cleared_tool_uses: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    old_ids: list[int] = field(default_factory=list)   # the prompts the edits relate (when edited)
    new_ids: list[int] = field(default_factory=list)

    @property
    def cleared_tokens(self) -> int:
        return self.tokens_before - self.tokens_after


def is_cleared(message: Message) -> bool:
    c = message.get("content")
    return isinstance(c, str) and c.startswith(CLEARED)


def placeholder(use: ToolUse, tokens: int, cfg: ClearToolUses) -> str:
    """With ``clear_tool_inputs`` the arguments are cleared too, and the placeholder shows them as
    cleared (``{}``): naming them would keep what was asked to go, and would make a second pass
    see a different placeholder (clearing must be idempotent)."""
    args = "{}" if cfg.clears_input(use.name) else use.arguments
    args = args if len(args) <= MAX_ARGS_CHARS else args[:MAX_ARGS_CHARS] + "..."
    return f"{CLEARED} " + cfg.placeholder.format(name=use.name, arguments=args, tokens=tokens)


def clear_tool_uses(messages: list[Message], renderer: PromptRenderer, cfg: ClearToolUses,
                    tools: list | None = None, wait: Callable[[int, int], bool] | None = None) -> ClearResult:
    """Clear every tool result older than the newest ``cfg.keep`` tool uses, once the prompt reaches
    ``cfg.trigger`` (input tokens, or tool uses). System and user messages are never touched; a call and its result stay
    together (only contents change); a result is cleared only where the placeholder is shorter;
    nothing is cleared unless at least ``cfg.clear_at_least`` tokens are freed. With ``cfg.clear_to``
    (agentkv's) the newest ``keep`` are cleared too, oldest first, while the prompt is above it, all
    but the newest tool use, which the model has not answered yet. ``wait(before, after)``: the
    policy's say on a batch once its size is known (true: not made now), asked before the prompts
    are rendered and diffed."""
    before = renderer.count(messages, tools)
    unchanged = ClearResult(messages, tokens_before=before, tokens_after=before)
    if cfg.trigger.type == "input_tokens" and not cfg.trigger.reached(before, 0):
        return unchanged  # decided without walking the conversation's tool uses
    uses = tool_uses(messages)
    if not cfg.trigger.reached(before, len(uses)):
        return unchanged
    answered = [u for u in uses if u.result_index is not None]
    protected = answered[len(answered) - cfg.keep:] if cfg.keep else []
    new = list(messages)
    kinds: dict[int, str] = {}
    cleared = 0

    def clear(use: ToolUse) -> None:
        nonlocal cleared
        at = use.result_index
        assert at is not None   # clear() is given answered uses only (``answered`` and its ``protected`` tail)
        result = new[at]
        if not is_cleared(result):
            tokens = renderer.count_text(_text(result.get("content")))
            text = placeholder(use, tokens, cfg)
            if renderer.count_text(text) < tokens:
                new[at] = {**result, "content": text}
                kinds[at] = "clear_tool_result"
                cleared += 1
        if cfg.clears_input(use.name) and use.arguments not in ("", "{}"):
            call_msg = copy.deepcopy(new[use.call_index])
            call_msg["tool_calls"][use.call_position]["function"]["arguments"] = "{}"
            new[use.call_index] = call_msg
            kinds.setdefault(use.call_index, "clear_tool_input")

    for use in answered:
        if use not in protected and not cfg.excluded(use.name):
            clear(use)
    after = renderer.count(new, tools) if kinds else before
    if cfg.clear_to is not None:     # a batch worth its cost: the kept ones too, oldest first, down to
        for use in protected[:-1]:   # the low-water mark (never the newest: the model has not read it)
            if after <= cfg.clear_to:
                break
            if not cfg.excluded(use.name):
                clear(use)
                after = renderer.count(new, tools)
    if not kinds:
        return unchanged
    if before - after < max(cfg.clear_at_least, 1) or (wait is not None and wait(before, after)):
        return unchanged
    old_prompt, new_prompt = renderer.render(messages, tools), renderer.render(new, tools)
    edits = diff_edits(old_prompt, new_prompt, kinds)
    return ClearResult(new, edits, cleared, before, after, old_prompt.token_ids, new_prompt.token_ids)
