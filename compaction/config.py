"""Context-management edit configs by their first import path: Anthropic's
`context_management.edits` entries, by their documented names (`clear_tool_uses_20250919`,
`clear_thinking_20251015`, `compact_20260112`) with their documented parameters and defaults, and
agentkv's short names (`clear_tool_uses`, `clear_thinking`, `compact`) as aliases.

Each kind is a class of its own, with what it does, in ``compaction.edit_kinds`` (its registry says
how to add one); this module names them for the code that imports them from here.

Amounts take a number or Anthropic's ``{"type": <unit>, "value": N}`` form; the unit is checked.
An edit keeps the name it was given (``type``), and its report uses that name.
"""

from __future__ import annotations

from .edit_kinds import ClearThinking, ClearToolUses, Compact
from .edit_kinds.clear_tool_uses import PLACEHOLDER
from .edit_kinds.compact import COMPACT_MIN_TRIGGER
from .edit_kinds.fields import Trigger, amount

__all__ = ["COMPACT_MIN_TRIGGER", "PLACEHOLDER", "ClearThinking", "ClearToolUses", "Compact", "Trigger", "amount"]
