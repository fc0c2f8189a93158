"""Torch reference of the copy-and-rotate step: the CPU execution path. Vectorized, chunked."""

from __future__ import annotations

import torch

from .layout import PagedKV
from .rope import RopeParams, rotate

CHUNK_TOKENS = 16384  # bounds the temporary float32 copy of the moved keys


def copy_rotate_torch(src: PagedKV, dst: PagedKV, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                      seg: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      rope: RopeParams | None) -> None:
    """``dst[dst_slots[i]] = rotate(src[src_slots[i]], segment seg[i])`` for K; V copied as is.

    ``rope=None`` copies keys unrotated. Moves must not overlap (see EvictionPlan.overlaps).
    """
    for lo in range(0, src_slots.numel(), CHUNK_TOKENS):
        s, d = src_slots[lo:lo + CHUNK_TOKENS], dst_slots[lo:lo + CHUNK_TOKENS]
        sb, so = s // src.block_size, s % src.block_size
        db, do = d // dst.block_size, d % dst.block_size
        k = src.key[sb, so]                      # [n, heads, head_dim]
        if rope is not None:
            g = seg[lo:lo + CHUNK_TOKENS].long()
            k = rotate(k, cos[g][:, None, :], sin[g][:, None, :], rope)
        dst.key[db, do] = k.to(dst.key.dtype)
        dst.value[db, do] = src.value[sb, so].to(dst.value.dtype)
