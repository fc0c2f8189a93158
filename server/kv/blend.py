"""Blend: which moved tokens are recomputed after clearing, and the passes that recompute them.

After clearing, ``shift`` moves every kept token's K/V; those K/V were computed while the cleared
results were still in the context. ``blend`` recomputes a ``fraction`` of the moved range (the new
prompt from the first cut on) to buy fidelity back. A strategy ranks that range's KV blocks and
the top ones are recomputed:

- ``tail``: the last blocks;
- ``cuts`` (EPIC-like): the first blocks after each cut, round robin over the cuts;
- ``deviation`` (CacheBlend-like): the blocks whose early-layer K/V moved most, measured by a
  probe (``kv.probe``) that runs the model's layer 0 and layer 1's K/V projections on the old, the
  priming and the new prompt.

vLLM's connector API supplies one contiguous range right after the prefix hit and vLLM computes
the rest. A range recomputed in the middle therefore takes a *pass*: a one-token request for the
new prompt up to the range's end, where the connector supplies only up to the range's start. Its
blocks enter vLLM's prefix cache (same cache salt), so the next pass and the request itself start
after it. Ranges are whole KV blocks: vLLM caches and hits whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Splice:
    """The new prompt after clearing, and where each of its tokens' K/V comes from."""

    ids: list[int]
    old_pos: np.ndarray     # new position -> position in the old prompt (-1: a replacement token)
    prime_pos: np.ndarray   # new position -> position in the priming prompt (-1: from the old prompt)
    first: int              # the first cut (new and old positions agree before it)
    cuts: list[int]         # new positions where each span's replacement starts


def splice(old_ids: Sequence[int], edits: Sequence) -> Splice:
    """Apply clearing's edits (``start``, ``end``, ``replacement_ids`` in the old prompt, sorted)."""
    ids: list[int] = []
    old_pos: list[int] = []
    prime_pos: list[int] = []
    cuts: list[int] = []
    first = edits[0].start
    at, primed = 0, first
    for e in edits:
        ids += old_ids[at:e.start]
        old_pos += range(at, e.start)
        prime_pos += [-1] * (e.start - at)
        cuts.append(len(ids))
        ids += e.replacement_ids
        old_pos += [-1] * len(e.replacement_ids)
        prime_pos += range(primed, primed + len(e.replacement_ids))
        primed += len(e.replacement_ids)
        at = e.end
    ids += old_ids[at:]
    old_pos += range(at, len(old_ids))
    prime_pos += [-1] * (len(old_ids) - at)
    return Splice(ids, np.asarray(old_pos), np.asarray(prime_pos), first, cuts)


def movable_end(sp: Splice, held_tokens: int) -> int:
    """New positions ``[0, end)`` have a held source: the connector holds the old prompt's first
    ``held_tokens`` tokens (the previous request's prompt) and every replacement token."""
    held = (sp.old_pos >= 0) & (sp.old_pos < held_tokens) | (sp.prime_pos >= 0)
    if not held.any():
        return 0
    return int(np.flatnonzero(held)[-1]) + 1


def candidates(sp: Splice, block_size: int, end: int) -> range:
    """Blocks that moving could supply: from the first cut's block to the last full block before
    ``end`` and before the prompt's last token (vLLM computes that one in any case)."""
    return range(sp.first // block_size, min(end, len(sp.ids) - 1) // block_size)


def budget_blocks(fraction: float, blocks: range) -> int:
    """Blocks recomputed for ``fraction`` of the movable blocks (at least one when above zero)."""
    if fraction <= 0 or not blocks:
        return 0
    return max(1, round(fraction * len(blocks)))


def rank(strategy: str, sp: Splice, blocks: range, block_size: int, deviation: np.ndarray | None = None) -> list[int]:
    """``blocks``, most worth recomputing first."""
    if strategy == "tail":
        return list(reversed(blocks))
    if strategy == "cuts":
        starts = sorted({c // block_size for c in sp.cuts})
        order: list[int] = []
        seen: set[int] = set()
        for j in range(len(blocks)):
            for s in starts:
                b = s + j
                if b in blocks and b not in seen:
                    seen.add(b)
                    order.append(b)
        return order
    if strategy == "deviation":
        if deviation is None:
            raise ValueError("the deviation strategy needs the probe's deviations")
        score = [float(deviation[b * block_size:(b + 1) * block_size].max()) for b in blocks]
        return [blocks[i] for i in np.argsort(score, kind="stable")[::-1]]
    raise ValueError(f"unknown blend strategy {strategy!r}")


def holes(chosen: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """The chosen blocks as merged token ranges ``[start, end)``, in order."""
    out: list[tuple[int, int]] = []
    for b in sorted(chosen):
        lo, hi = b * block_size, (b + 1) * block_size
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


@dataclass(frozen=True)
class Plan:
    passes: list[tuple[int, int]]   # (limit, end): a request for ids[:end] supplied up to limit
    limit: int | None               # the request's own limit (a recomputed range reaching its end)
    movable_tokens: int             # tokens in the movable blocks
    recompute_tokens: int           # tokens the chosen ranges hold


def plan(strategy: str, fraction: float, sp: Splice, block_size: int, held_tokens: int,
         deviation: np.ndarray | None = None) -> Plan:
    blocks = candidates(sp, block_size, movable_end(sp, held_tokens))
    chosen = rank(strategy, sp, blocks, block_size, deviation)[:budget_blocks(fraction, blocks)]
    ranges = holes(chosen, block_size)
    limit = None
    if ranges and ranges[-1][1] >= blocks.stop * block_size:
        limit = ranges.pop()[0]
    return Plan(ranges, limit, len(blocks) * block_size, len(chosen) * block_size)
