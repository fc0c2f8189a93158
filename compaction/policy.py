"""A context-management policy: the ordered edits to apply, and the default for a context window.

Default (first seed: clearing breaks the prefix cache, so it must be rare and worth its cost). The
levels are fractions of the *room*: the window less the fixed part (system prompt and tools, which
an agent's can make half the window), since only the rest can be cleared. Clear old tool results
when the prompt fills ``clear_at`` of the room, in one batch down to ``clear_to`` of it
(the newest 3 tool uses are kept unless that takes more: then all but the newest), so the session
runs many turns before the next edit (a batch that cannot bring the prompt under ``clear_at`` waits
for the summary: ``ClearToolUses.left_to_summary``); summarize at ``compact_at`` of the room,
keeping the newest 30% of it word for word and up to 5% of the window of user messages copied into
the summary; the note itself at most 1/8 of the window (1024 tokens). The fractions' defaults are
``ServeConfig``'s (``--clear-at``, ``--clear-to``, ``--compact-at``). A fixed part that leaves less
than ``MIN_ROOM`` of the window is said once (``room_warning``) instead of thrashing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .edit_kinds import ClearToolUses, Compact, EditKind, edit_union

if TYPE_CHECKING:
    Edit = EditKind   # what a type checker can know of a union built at run time
else:
    Edit = edit_union()   # one entry of ``edits``: the registered kinds (``edit_kinds``), told apart by ``type``


class ContextManagement(BaseModel):
    """The body's ``context_management`` object (Anthropic's shape)."""

    model_config = ConfigDict(extra="forbid")

    edits: list[Edit] = Field(default_factory=list, max_length=8)

    @field_validator("edits")
    @classmethod
    def _first(cls, edits: list[EditKind]) -> list[EditKind]:
        for e in edits[1:]:   # clear_thinking: Anthropic's rule
            if e.must_be_first:
                raise ValueError(f"{e.NAME} must be the first edit")
        return edits


def summary_limit(window: int) -> int:
    """The length limit of a summary the server writes for a ``window``-token model: an eighth of
    the window, 16 to 1,024 tokens."""
    return max(16, min(1024, window // 8))


MIN_ROOM = 0.25   # a fixed part leaving less of the window than this is reported


def default_policy(window: int, fixed: int, clear_at: float, clear_to: float, compact_at: float) -> ContextManagement:
    """The server default for a ``window``-token model and a request whose system prompt and tools
    are ``fixed`` tokens (levels: fractions of the room the fixed part leaves)."""
    fixed = min(max(fixed, 0), window)
    room = window - fixed
    return ContextManagement(edits=[
        ClearToolUses(trigger=fixed + int(room * clear_at), keep=3, clear_to=fixed + int(room * clear_to),
                      clear_at_least=int(room * 0.1)),
        Compact(trigger=fixed + int(room * compact_at), keep_recent_tokens=int(room * 0.3),
                user_messages_tokens=int(window * 0.05), summary_max_tokens=summary_limit(window)),
    ])


def room_warning(window: int, fixed: int) -> str | None:
    """What to tell a client whose system prompt and tools leave little of the window to clear."""
    if not window or window - fixed >= window * MIN_ROOM:
        return None
    return (f"the system prompt and tools are {fixed} of the {window}-token window: {window - fixed} tokens "
            f"are left for the conversation, so clearing and summaries can keep only a few turns")


def with_defaults(requested: ContextManagement | None, default: ContextManagement | None) -> ContextManagement | None:
    """The policy a request runs. No ``context_management``: the server default. ``{"edits": []}``:
    no management. Edits that name a kind the default has (clearing, compaction): exactly those.
    Edits that name none (Claude Code sends ``clear_thinking`` alone on every request): those, then
    the server default's, so asking for one unrelated edit does not switch the default off."""
    if requested is None:
        return default
    if not requested.edits or default is None:
        return requested
    if {type(e) for e in requested.edits} & {type(e) for e in default.edits}:
        return requested
    return ContextManagement(edits=list(requested.edits) + list(default.edits))
