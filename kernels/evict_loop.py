"""Per-token loop: the plainest statement of the copy-and-rotate step (test oracle, benchmark baseline)."""

from __future__ import annotations

import torch

from .layout import PagedKV
from .rope import RopeParams, rotate


def copy_rotate_loop(src: PagedKV, dst: PagedKV, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     seg: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rope: RopeParams | None) -> None:
    staged = []
    for s, g in zip(src_slots.tolist(), seg.tolist()):
        k = src.key[s // src.block_size, s % src.block_size]       # [heads, head_dim]
        v = src.value[s // src.block_size, s % src.block_size].clone()
        staged.append((rotate(k, cos[g], sin[g], rope) if rope is not None else k.clone(), v))
    for d, (k, v) in zip(dst_slots.tolist(), staged):
        dst.key[d // dst.block_size, d % dst.block_size] = k
        dst.value[d // dst.block_size, d % dst.block_size] = v
