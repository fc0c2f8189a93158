"""``clear_thinking`` (Anthropic's ``clear_thinking_20251015``): the reasoning of older assistant
turns leaves the prompt (``compaction.thinking``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from agentkv.compaction.prompt import Message
from agentkv.compaction.thinking import clear_thinking

from .base import Applied, EditKind, EditStep
from .fields import amount


class ClearThinking(EditKind):
    """Drop the reasoning of all but the newest ``keep`` assistant turns that have some
    (``"all"``: keep every turn's). Must be the first edit, as Anthropic requires."""

    must_be_first = True

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

    def apply(self, view: list[Message], step: EditStep) -> Applied | None:
        r = clear_thinking(view, step.renderer, self, step.tools)
        if not r.cleared_turns:
            return None
        return Applied(r.messages, {"type": self.type, "cleared_thinking_turns": r.cleared_turns,
                                    "cleared_input_tokens": r.cleared_tokens},
                       replaced=[i for i, (a, b) in enumerate(zip(view, r.messages)) if a is not b],
                       moves_tokens=r.cleared_tokens > 0)
