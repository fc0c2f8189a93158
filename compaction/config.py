"""Context-management edit configs: Anthropic's `context_management.edits` entries, by their
documented names (`clear_tool_uses_20250919`, `clear_thinking_20251015`, `compact_20260112`) with
their documented parameters and defaults, and agentkv's short names (`clear_tool_uses`,
`clear_thinking`, `compact`) as aliases.

Amounts take a number or Anthropic's ``{"type": <unit>, "value": N}`` form; the unit is checked.
An edit keeps the name it was given (``type``), and its report uses that name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PLACEHOLDER = ("{name}({arguments}) returned {tokens} tokens, cleared from the context. The full "
               "output is in the session log: call recall with words from it, or run the tool again.")
COMPACT_MIN_TRIGGER = 50_000  # Anthropic's minimum for compact_20260112


def amount(v: Any, *units: str) -> Any:
    """``N`` or ``{"type": unit, "value": N}`` -> N (the unit must be one of ``units``)."""
    if isinstance(v, dict):
        if set(v) != {"type", "value"}:
            raise ValueError(f"expected a number or {{\"type\": {' | '.join(units)}, \"value\": N}}")
        if v["type"] not in units:
            raise ValueError(f"type must be {' or '.join(repr(u) for u in units)}, not {v['type']!r}")
        return v["value"]
    return v


class _Edit(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Trigger(BaseModel):
    """When clearing runs: at ``value`` input tokens, or at ``value`` tool uses in the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["input_tokens", "tool_uses"] = "input_tokens"
    value: int = Field(..., ge=0)

    def reached(self, input_tokens: int, tool_uses: int) -> bool:
        return (input_tokens if self.type == "input_tokens" else tool_uses) >= self.value


class ClearToolUses(_Edit):
    """Replace old tool results with a placeholder once the prompt reaches ``trigger``."""

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


class ClearThinking(_Edit):
    """Drop the reasoning of all but the newest ``keep`` assistant turns that have some
    (``"all"``: keep every turn's). Must be the first edit, as Anthropic requires."""

    type: Literal["clear_thinking", "clear_thinking_20251015"] = "clear_thinking"
    keep: int | Literal["all"] = Field(1, description="newest thinking turns kept: N, {type: thinking_turns, "
                                                     "value: N} or \"all\"")

    @field_validator("keep", mode="before")
    @classmethod
    def _keep(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") == "all" and set(v) == {"type"}:
            return "all"
        return amount(v, "thinking_turns")

    @field_validator("keep")
    @classmethod
    def _non_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("keep must be >= 0")
        return v


class Compact(_Edit):
    """Summarize the oldest part of the conversation once the prompt reaches ``trigger`` tokens.

    ``compact_20260112`` (Anthropic's): everything before the point of compaction is summarized
    (``keep_recent_tokens`` defaults to 0), ``trigger`` is at least 50,000; the response carries a
    ``compaction`` block, and with ``pause_after_compaction`` it stops there (no generation)."""

    type: Literal["compact", "compact_20260112"] = "compact"
    trigger: int = Field(150_000, ge=0, description="input tokens at which summarization runs")
    pause_after_compaction: bool = Field(False, description="answer with the compaction alone")
    instructions: str | None = Field(None, description="replaces the default summary prompt")
    keep_recent_tokens: int = Field(20_000, ge=0, description="newest tokens kept word for word")
    user_messages_tokens: int = Field(8_000, ge=0, description="budget of user messages copied verbatim")
    summary_max_tokens: int = Field(1024, ge=16, description="length limit of the handoff note")
    always: bool = Field(False, description="summarize even where the summary is not shorter than what it "
                                            "replaces (compaction asked for outright)")

    @field_validator("trigger", mode="before")
    @classmethod
    def _trigger(cls, v: Any) -> Any:
        return 150_000 if v is None else amount(v, "input_tokens")

    @model_validator(mode="before")
    @classmethod
    def _official_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "compact_20260112":
            data = {"keep_recent_tokens": 0, **data}
        return data

    @model_validator(mode="after")
    def _official_minimum(self) -> Compact:
        if self.type == "compact_20260112" and self.trigger < COMPACT_MIN_TRIGGER:
            raise ValueError(f"compact_20260112: trigger must be at least {COMPACT_MIN_TRIGGER} input tokens "
                             "(use agentkv's 'compact' for a lower one)")
        return self
