"""Field types the edit kinds share: an amount in a unit (``amount``), and clearing's ``Trigger``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def amount(v: Any, *units: str) -> Any:
    """``N`` or ``{"type": unit, "value": N}`` -> N (the unit must be one of ``units``)."""
    if isinstance(v, dict):
        if set(v) != {"type", "value"}:
            raise ValueError(f"expected a number or {{\"type\": {' | '.join(units)}, \"value\": N}}")
        if v["type"] not in units:
            raise ValueError(f"type must be {' or '.join(repr(u) for u in units)}, not {v['type']!r}")
        return v["value"]
    return v


class Trigger(BaseModel):
    """When clearing runs: at ``value`` input tokens, or at ``value`` tool uses in the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["input_tokens", "tool_uses"] = "input_tokens"
    value: int = Field(..., ge=0)

    def reached(self, input_tokens: int, tool_uses: int) -> bool:
        return (input_tokens if self.type == "input_tokens" else tool_uses) >= self.value
