"""A context-management policy: the ordered edits to apply, and the default for a context window.

Default (first seed): clear old tool results at 50% of the window, in batches that free at least
10% of it (clearing breaks the prefix cache, so it should not fire for little); summarize at 75%,
keeping the newest 30% word for word and up to 5% of user messages copied into the summary; the
note itself at most 1/8 of the window (1024 tokens).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .config import ClearThinking, ClearToolUses, Compact

Edit = Annotated[ClearToolUses | ClearThinking | Compact, Field(discriminator="type")]


class ContextManagement(BaseModel):
    """The body's ``context_management`` object (Anthropic's shape)."""

    model_config = ConfigDict(extra="forbid")

    edits: list[Edit] = Field(default_factory=list, max_length=8)

    @field_validator("edits")
    @classmethod
    def _thinking_first(cls, edits: list) -> list:
        if any(isinstance(e, ClearThinking) for e in edits[1:]):
            raise ValueError("clear_thinking must be the first edit")
        return edits


def summary_limit(window: int) -> int:
    """The length limit of a summary the server writes for a ``window``-token model: an eighth of
    the window, 16 to 1,024 tokens."""
    return max(16, min(1024, window // 8))


def default_policy(window: int, clear_at: float = 0.5, compact_at: float = 0.75) -> ContextManagement:
    return ContextManagement(edits=[
        ClearToolUses(trigger=int(window * clear_at), keep=3, clear_at_least=int(window * 0.1)),
        Compact(trigger=int(window * compact_at), keep_recent_tokens=int(window * 0.3),
                user_messages_tokens=int(window * 0.05), summary_max_tokens=summary_limit(window)),
    ])


def with_defaults(requested: ContextManagement | None, default: ContextManagement | None) -> ContextManagement | None:
    """The policy a request runs. No ``context_management``: the server default. ``{"edits": []}``:
    no management. Edits that name clearing or compaction: exactly those. Edits that name neither
    (Claude Code sends ``clear_thinking`` alone on every request): those, then the server default's
    clearing and compaction, so asking for one unrelated edit does not switch the default off."""
    if requested is None:
        return default
    if not requested.edits or default is None:
        return requested
    if any(isinstance(e, (ClearToolUses, Compact)) for e in requested.edits):
        return requested
    return ContextManagement(edits=list(requested.edits) + list(default.edits))
