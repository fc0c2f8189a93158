"""Prompt edits: which token span of the old rendered prompt was replaced by which tokens.

The KV kernel consumes these: ``Span(start, end, len(replacement_ids))`` per edit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prompt import RenderedPrompt


@dataclass(frozen=True)
class PromptEdit:
    message_index: int
    kind: str                 # clear_tool_result | clear_tool_input
    start: int                # token offsets in the old prompt, [start, end)
    end: int
    replacement_ids: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"message_index": self.message_index, "kind": self.kind, "start": self.start,
                "end": self.end, "replacement_tokens": len(self.replacement_ids)}


def diff_edits(old: RenderedPrompt, new: RenderedPrompt, kinds: dict[int, str]) -> list[PromptEdit]:
    """Minimal token-span edits between two renders of the same number of messages; only the
    messages in ``kinds`` may differ. The header and other segments must be equal token for token."""
    if len(old.ranges) != len(new.ranges):
        raise ValueError("diff_edits needs the same messages, edited in place")
    edits = []
    for i in range(len(old.ranges)):
        a, b = old.segment(i), new.segment(i)
        if a == b:
            continue
        if i not in kinds:
            raise ValueError(f"message {i} changed its tokens but was not edited")
        lcp = 0
        while lcp < min(len(a), len(b)) and a[lcp] == b[lcp]:
            lcp += 1
        lcs = 0
        while lcs < min(len(a), len(b)) - lcp and a[-1 - lcs] == b[-1 - lcs]:
            lcs += 1
        start = old.ranges[i][0] + lcp
        edits.append(PromptEdit(i, kinds[i], start, old.ranges[i][1] - lcs, tuple(b[lcp:len(b) - lcs])))
    return edits


def apply_edits(token_ids: list[int], edits: list[PromptEdit]) -> list[int]:
    """The new prompt's tokens from the old ones and the edits (checks and documents the contract)."""
    out, pos = [], 0
    for e in sorted(edits, key=lambda e: e.start):
        out += token_ids[pos:e.start] + list(e.replacement_ids)
        pos = e.end
    return out + token_ids[pos:]
