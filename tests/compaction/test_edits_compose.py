"""Edits of one prompt composed with edits of the prompt they made: the result, applied to the
first prompt, gives the last; tokens both keep stay outside every span (so their K/V can move)."""

from __future__ import annotations

import random

from agentkv.compaction.edits import PromptEdit, apply_edits, compose, span_edit


def random_edits(rng: random.Random, ids: list[int], fresh: list[int]) -> list[PromptEdit]:
    """A few disjoint spans of ``ids``, each replaced by new tokens (from ``fresh``)."""
    cuts = sorted(rng.choices(range(len(ids) + 1), k=2 * rng.randint(0, 3)))
    out = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        rep = tuple(fresh.pop() for _ in range(rng.randint(0, 4)))
        if a < b or rep:
            out.append(PromptEdit(0, "clear", a, b, rep))
    return out


def kept_tokens(ids: list[int], edits: list[PromptEdit]) -> set[int]:
    inside = {p for e in edits for p in range(e.start, e.end)}
    return {ids[p] for p in range(len(ids)) if p not in inside}


def test_composed_edits_give_the_last_prompt_and_keep_what_both_kept():
    rng = random.Random(7)
    for _ in range(500):
        fresh = list(range(10_000, 10_400))
        old = list(range(rng.randint(0, 40)))                  # distinct ids: kept tokens are traceable
        first = random_edits(rng, old, fresh)
        mid = apply_edits(old, first)
        second = random_edits(rng, mid, fresh)
        new = apply_edits(mid, second)
        both = compose(first, old, second, mid, new)
        assert apply_edits(old, both) == new
        assert all(e.start <= e.end for e in both) and all(x.end <= y.start for x, y in zip(both, both[1:]))
        # an old token survives into the new prompt exactly when the composed edits keep it
        assert kept_tokens(old, both) == {t for t in kept_tokens(old, first) if t in kept_tokens(mid, second)}


def test_a_summary_absorbs_the_clears_inside_it_and_leaves_the_later_ones():
    old = list(range(100))
    clears = [PromptEdit(3, "clear_tool_result", 20, 30, (900,)), PromptEdit(9, "clear_tool_result", 70, 80, (901,))]
    mid = apply_edits(old, clears)                             # 82 tokens; the second clear at 61..62
    summary = span_edit(mid, mid[:10] + [500, 501, 502] + mid[40:], 1, "summary")
    assert summary == [PromptEdit(1, "summary", 10, 40, (500, 501, 502))]
    new = apply_edits(mid, summary)
    both = compose(clears, old, summary, mid, new)
    assert [(e.start, e.end, e.replacement_ids) for e in both] == [(10, 49, (500, 501, 502)), (70, 80, (901,))]
    assert apply_edits(old, both) == new


def test_span_edit_of_equal_prompts_is_no_edit():
    assert span_edit([1, 2, 3], [1, 2, 3], 0, "summary") == []
    assert span_edit([1, 2, 3], [1, 2, 3, 4], 0, "summary") == [PromptEdit(0, "summary", 3, 3, (4,))]
