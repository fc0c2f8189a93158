"""``clear_tool_uses`` (Anthropic's ``clear_tool_uses_20250919``): old tool results leave the
prompt for a placeholder; the prompt edits go to the KV connector (``compaction.clearing``)."""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field, field_validator

from agentkv.compaction.clearing import clear_tool_uses
from agentkv.compaction.prompt import Message

from .base import Applied, EditKind, EditStep
from .fields import Trigger, amount

PLACEHOLDER = ("{name}({arguments}) returned {tokens} tokens, cleared from the context. The full "
               "output is in the session log: call recall with words from it, or run the tool again.")


class ClearToolUses(EditKind):
    """Replace old tool results with a placeholder once the prompt reaches ``trigger``."""

    kv_report = True

    type: Literal["clear_tool_uses", "clear_tool_uses_20250919"] = "clear_tool_uses"
    trigger: Trigger = Field(Trigger(value=100_000),
                             description="input tokens (a number) or {type: input_tokens | tool_uses, value}")
    keep: int = Field(3, ge=0, description="newest tool uses never cleared")
    clear_at_least: int = Field(0, ge=0, description="clear only if this many tokens are freed")
    clear_to: int | None = Field(None, ge=0, description="agentkv: a low-water mark in input tokens: once clearing "
                                 "runs, the newest kept tool uses are cleared too (oldest first, never the newest) "
                                 "while the prompt is above it, so one batch buys many turns")
    exclude_tools: list[str] | None = Field(None, description="tools never cleared")
    clear_tool_inputs: bool | list[str] = Field(
        False, description="also clear the calls' arguments: all (true) or those of the tools named")
    placeholder: str = Field(PLACEHOLDER, description="text of a cleared result: {name} {arguments} {tokens}")

    @field_validator("trigger", mode="before")
    @classmethod
    def _trigger(cls, v: Any) -> Any:
        return {"type": "input_tokens", "value": v} if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("keep", mode="before")
    @classmethod
    def _keep(cls, v: Any) -> Any:
        return amount(v, "tool_uses")

    @field_validator("clear_at_least", mode="before")
    @classmethod
    def _at_least(cls, v: Any) -> Any:
        return 0 if v is None else amount(v, "input_tokens")

    @field_validator("clear_to", mode="before")
    @classmethod
    def _clear_to(cls, v: Any) -> Any:
        return None if v is None else amount(v, "input_tokens")

    @field_validator("clear_tool_inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return False if v is None else v

    def excluded(self, tool: str) -> bool:
        return tool in (self.exclude_tools or ())

    def clears_input(self, tool: str) -> bool:
        c = self.clear_tool_inputs
        return c if isinstance(c, bool) else tool in c

    def left_to_summary(self, tokens_before: int, tokens_after: int, edits: list[EditKind],
                        window: int | None) -> bool:
        """Whether a low-water batch (``clear_to``) waits for a later edit of ``edits`` (a summary,
        see ``EditKind.defers_clearing``): it cannot bring the prompt under its own trigger (what is
        left is text, which only a summary reduces), so made now it would fire again on every turn,
        each time clearing a little. Anthropic's own clearing (no ``clear_to``) never waits."""
        if self.clear_to is None or self.trigger.type != "input_tokens" or not self.trigger.reached(tokens_after, 0):
            return False
        return any(e.defers_clearing(tokens_before, window) for e in edits)

    def apply(self, view: list[Message], step: EditStep) -> Applied | None:
        r = clear_tool_uses(view, step.renderer, self, step.tools,
                            wait=functools.partial(self.left_to_summary, edits=step.edits, window=step.window))
        if not r.edits:
            return None
        return Applied(r.messages, {"type": self.type, "cleared_tool_uses": r.cleared_tool_uses,
                                    "cleared_input_tokens": r.cleared_tokens,
                                    "edits": [e.as_dict() for e in r.edits]},
                       replaced={e.message_index for e in r.edits}, kv_edits=r.edits, old_ids=r.old_ids)
