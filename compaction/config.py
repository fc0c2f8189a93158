"""Context-management edit configs, mirroring Anthropic's `context_management.edits` entries.

Thresholds accept a number or Anthropic's ``{"type": "input_tokens", "value": N}`` form.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PLACEHOLDER = ("{name}({arguments}) returned {tokens} tokens, cleared from the context. The full "
               "output is in the session log: call recall with words from it, or run the tool again.")


def _unwrap(v: Any) -> Any:
    if isinstance(v, dict) and "value" in v:
        return v["value"]
    return v


class _Edit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("trigger", "keep", "clear_at_least", mode="before", check_fields=False)
    @classmethod
    def _thresholds(cls, v: Any) -> Any:
        return _unwrap(v)


class ClearToolUses(_Edit):
    """Replace old tool results with a placeholder once the prompt reaches ``trigger`` tokens."""

    type: Literal["clear_tool_uses"] = "clear_tool_uses"
    trigger: int = Field(100_000, ge=0, description="input tokens at which clearing runs")
    keep: int = Field(3, ge=0, description="newest tool uses never cleared")
    clear_at_least: int = Field(0, ge=0, description="clear only if this many tokens are freed")
    exclude_tools: list[str] = Field(default_factory=list, description="tools never cleared")
    clear_tool_inputs: bool = Field(False, description="also clear the calls' arguments")
    placeholder: str = Field(PLACEHOLDER, description="text of a cleared result: {name} {arguments} {tokens}")


class Compact(_Edit):
    """Summarize the oldest part of the conversation once the prompt reaches ``trigger`` tokens."""

    type: Literal["compact"] = "compact"
    trigger: int = Field(150_000, ge=0, description="input tokens at which summarization runs")
    keep_recent_tokens: int = Field(20_000, ge=0, description="newest tokens kept word for word")
    user_messages_tokens: int = Field(8_000, ge=0, description="budget of user messages copied verbatim")
    summary_max_tokens: int = Field(1024, ge=16, description="length limit of the handoff note")
    instructions: str | None = Field(None, description="replaces the default summary prompt")
