"""Eviction plans: which cached token moves from which slot to which slot, and by what delta.

Source positions ``0..src_len-1`` live in ``src_block_table``. Dropping span ``[start, end)`` (and
putting ``replacement`` tokens in its place) moves every later token by the same delta, so a plan
has one delta per *segment* (the run of kept tokens between two spans). Kernels rotate keys by
their segment's delta and never compute angles themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import slots_of


@dataclass(frozen=True)
class Span:
    """Source positions ``[start, end)`` are dropped; ``replacement`` new tokens take their place."""

    start: int
    end: int
    replacement: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start or self.replacement < 0:
            raise ValueError(f"invalid span {self}")

    @property
    def delta(self) -> int:
        return self.replacement - (self.end - self.start)


@dataclass(frozen=True)
class EvictionPlan:
    """Kept tokens: ``src_slots[i] -> dst_slots[i]`` rotated by ``deltas[seg[i]]``.
    Replacement tokens: row ``j`` of the supplied K/V goes to ``replacement_slots[j]``."""

    src_len: int
    dst_len: int
    kept_positions: torch.Tensor      # [n_kept] int64, source positions of kept tokens
    new_positions: torch.Tensor       # [n_kept] int64, their destination positions
    src_slots: torch.Tensor           # [n_moved] int64 (no-op moves removed)
    dst_slots: torch.Tensor           # [n_moved] int64
    seg: torch.Tensor                 # [n_moved] int32, index into deltas
    deltas: torch.Tensor              # [n_segments] int64, position delta of each segment
    replacement_positions: torch.Tensor  # [n_replacement] int64, destination positions
    replacement_slots: torch.Tensor   # [n_replacement] int64
    skip_unmoved: bool = False        # same-slot, same-position tokens left out: same cache only

    @property
    def n_moved(self) -> int:
        return int(self.src_slots.numel())

    def overlaps(self) -> bool:
        """True if some move writes a slot that another move still has to read (in-place compaction)."""
        if self.n_moved == 0:
            return False
        return bool(torch.isin(self.dst_slots, self.src_slots).any()
                    or torch.isin(self.replacement_slots, self.src_slots).any())


def _validate(spans: Sequence[Span], src_len: int) -> list[Span]:
    spans = sorted(spans, key=lambda s: s.start)
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise ValueError(f"spans overlap: {a} and {b}")
    if spans and spans[-1].end > src_len:
        raise ValueError(f"span {spans[-1]} ends past the source length {src_len}")
    return spans


def build_plan(src_len: int, spans: Sequence[Span], src_block_table: torch.Tensor,
               dst_block_table: torch.Tensor, block_size: int, dst_block_size: int | None = None,
               skip_unmoved: bool = True) -> EvictionPlan:
    """Plan the moves. With ``skip_unmoved``, tokens whose slot and position stay the same (the
    shared prefix, in place) are left out: they need no work, but only when source and destination
    are the same cache (``apply_plan`` refuses such a plan across two caches)."""
    spans = _validate(spans, src_len)
    dst_block_size = dst_block_size or block_size
    device = src_block_table.device
    ends = torch.tensor([s.end for s in spans], dtype=torch.int64)
    seg_delta = torch.tensor([0] + [s.delta for s in spans], dtype=torch.int64).cumsum(0)

    pos = torch.arange(src_len, dtype=torch.int64)
    dropped = torch.zeros(src_len, dtype=torch.bool)
    for s in spans:
        dropped[s.start:s.end] = True
    kept = pos[~dropped]
    seg = torch.searchsorted(ends, kept, right=True) if spans else torch.zeros_like(kept)
    new = kept + seg_delta[seg]
    dst_len = src_len + int(seg_delta[-1])

    rep_pos = torch.cat([torch.arange(s.replacement, dtype=torch.int64) + s.start + int(seg_delta[i])
                         for i, s in enumerate(spans)]) if spans else torch.zeros(0, dtype=torch.int64)
    need_blocks = -(-dst_len // dst_block_size)
    if dst_block_table.numel() < need_blocks:
        raise ValueError(f"destination needs {need_blocks} blocks for {dst_len} tokens, "
                         f"table has {dst_block_table.numel()}")
    src_slots = slots_of(kept.to(device), src_block_table, block_size)
    dst_slots = slots_of(new.to(device), dst_block_table, dst_block_size)
    seg_d = seg.to(device, torch.int32)
    if skip_unmoved:
        moving = (src_slots != dst_slots) | (new != kept).to(device)
        src_slots, dst_slots, seg_d = src_slots[moving], dst_slots[moving], seg_d[moving]
    return EvictionPlan(src_len, dst_len, kept, new, src_slots, dst_slots, seg_d, seg_delta,
                        rep_pos, slots_of(rep_pos.to(device), dst_block_table, dst_block_size), skip_unmoved)
