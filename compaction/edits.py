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


def _common_ends(a: list[int], b: list[int]) -> tuple[int, int]:
    """Lengths of the common prefix and (not overlapping it) the common suffix of ``a`` and ``b``."""
    lcp = 0
    while lcp < min(len(a), len(b)) and a[lcp] == b[lcp]:
        lcp += 1
    lcs = 0
    while lcs < min(len(a), len(b)) - lcp and a[-1 - lcs] == b[-1 - lcs]:
        lcs += 1
    return lcp, lcs


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
        lcp, lcs = _common_ends(a, b)
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


def span_edit(old_ids: list[int], new_ids: list[int], message_index: int, kind: str) -> list[PromptEdit]:
    """``old_ids`` -> ``new_ids`` as one span: what lies between their common prefix and suffix."""
    lcp, lcs = _common_ends(old_ids, new_ids)
    if lcp == len(old_ids) == len(new_ids):
        return []
    return [PromptEdit(message_index, kind, lcp, len(old_ids) - lcs, tuple(new_ids[lcp:len(new_ids) - lcs]))]


def _kept(edits: list[PromptEdit], length: int) -> list[tuple[int, int, int]]:
    """``(old_start, new_start, n)``: the runs of a prompt of ``length`` tokens the edits keep, and
    where they land."""
    out, pos, shift = [], 0, 0
    for e in sorted(edits, key=lambda e: e.start):
        if e.start > pos:
            out.append((pos, pos + shift, e.start - pos))
        shift += len(e.replacement_ids) - (e.end - e.start)
        pos = e.end
    if length > pos:
        out.append((pos, pos + shift, length - pos))
    return out


def compose(first: list[PromptEdit], old_ids: list[int], second: list[PromptEdit], mid_ids: list[int],
            new_ids: list[int]) -> list[PromptEdit]:
    """Edits of ``old_ids`` giving ``new_ids``, from ``first`` (``old_ids`` -> ``mid_ids``) then
    ``second`` (``mid_ids`` -> ``new_ids``): a token of ``old_ids`` is kept where both keep it, and
    each gap between kept runs is one edit (what ``second`` replaced inside or across ``first``'s
    spans is absorbed into it). Checked: when the result does not give ``new_ids``, one span."""
    kept_mid = _kept(first, len(old_ids))                  # (old, mid, n): old tokens mid still has
    kept = []                                              # (old, new, n): ... new still has too
    for m2, n2, k2 in _kept(second, len(mid_ids)):         # runs of mid that second keeps
        for o, m, n in kept_mid:
            lo, hi = max(m, m2), min(m + n, m2 + k2)
            if lo < hi:
                kept.append((o + lo - m, n2 + lo - m2, hi - lo))
    out: list[PromptEdit] = []
    prev_old = prev_new = 0
    kind = "+".join(dict.fromkeys(e.kind for e in sorted(first + second, key=lambda e: e.start)))
    index = min((e.message_index for e in first + second), default=0)
    for o, n, k in kept + [(len(old_ids), len(new_ids), 0)]:
        if o > prev_old or n > prev_new:
            out.append(PromptEdit(index, kind, prev_old, o, tuple(new_ids[prev_new:n])))
        prev_old, prev_new = o + k, n + k
    if apply_edits(old_ids, out) != new_ids:   # pragma: no cover - kept runs are monotone in both
        return span_edit(old_ids, new_ids, index, kind)
    return out
