"""`evict_spans`: drop spans from a sequence's paged KV and move the later tokens down, re-rotating
their keys, instead of recomputing them. Picks Triton on CUDA and the torch reference elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from .evict_loop import copy_rotate_loop
from .evict_torch import copy_rotate_torch
from .layout import PagedKV
from .plan import EvictionPlan, Span, build_plan
from .rope import RopeParams

Backend = Literal["auto", "triton", "torch", "loop"]


def _backend(name: Backend, device: torch.device) -> Callable:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from .evict_triton import copy_rotate_triton  # imports triton only when used

        return copy_rotate_triton
    return {"torch": copy_rotate_torch, "loop": copy_rotate_loop}[name]


def _same_cache(a: PagedKV, b: PagedKV) -> bool:
    return a.key.untyped_storage().data_ptr() == b.key.untyped_storage().data_ptr()


def _check_pair(src: PagedKV, dst: PagedKV, rope: RopeParams) -> None:
    if src.head_dim != rope.head_dim:
        raise ValueError(f"cache head_dim {src.head_dim} != rope head_dim {rope.head_dim}")
    if (dst.num_kv_heads, dst.head_dim) != (src.num_kv_heads, src.head_dim):
        raise ValueError(f"destination heads x head_dim {dst.num_kv_heads} x {dst.head_dim} != source "
                         f"{src.num_kv_heads} x {src.head_dim}")


def apply_plan(layers: Sequence[PagedKV], plan: EvictionPlan, rope: RopeParams,
               replacement: Sequence[PagedKV] | None = None, dst_layers: Sequence[PagedKV] | None = None,
               backend: Backend = "auto") -> None:
    """Run ``plan`` on every layer. ``dst_layers`` default to ``layers`` (same cache, other blocks or
    in place); another cache may have another block size. Overlapping moves within one cache are
    staged through a temporary copy of the moved rows, costing ``n_moved * heads * head_dim * 2``
    elements of extra memory for one layer at a time."""
    dst_layers = dst_layers or layers
    if len(dst_layers) != len(layers) or (replacement is not None and len(replacement) != len(layers)):
        raise ValueError("one source, destination and replacement cache per layer")
    if not layers:
        return
    fn = _backend(backend, layers[0].key.device)
    device = layers[0].key.device
    cos, sin = rope.cos_sin(plan.deltas, device)
    no_seg = torch.zeros(1, 1, device=device)
    overlaps = plan.overlaps()
    for i, (src, dst) in enumerate(zip(layers, dst_layers)):
        _check_pair(src, dst, rope)
        same = _same_cache(src, dst)
        if plan.skip_unmoved and not same:
            raise ValueError("a plan built with skip_unmoved applies within one cache only")
        src_slots, from_cache = plan.src_slots, src
        if same and overlaps:
            n = plan.n_moved
            rows = PagedKV.from_rows(src.key.new_empty(n, src.num_kv_heads, src.head_dim),
                                     src.value.new_empty(n, src.num_kv_heads, src.head_dim))
            idx = torch.arange(n, device=device)
            fn(src, rows, plan.src_slots, idx, plan.seg, no_seg, no_seg, None)
            src_slots, from_cache = idx, rows
        fn(from_cache, dst, src_slots, plan.dst_slots, plan.seg, cos, sin, rope)
        if replacement is not None and plan.replacement_slots.numel():
            rep = replacement[i]
            fn(rep, dst, torch.arange(rep.key.shape[0], device=device), plan.replacement_slots,
               torch.zeros_like(plan.replacement_slots, dtype=torch.int32), no_seg, no_seg, None)


def move_tokens(src: PagedKV, dst: PagedKV, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                deltas: torch.Tensor, rope: RopeParams, backend: Backend = "auto") -> None:
    """Move tokens ``src_slots[i] -> dst_slots[i]``, rotating keys by ``deltas[i]`` positions.
    Moves must not overlap (distinct caches, or disjoint slots)."""
    if not src_slots.numel() == dst_slots.numel() == deltas.numel():
        raise ValueError(f"{src_slots.numel()} source slots, {dst_slots.numel()} destination slots and "
                         f"{deltas.numel()} deltas: one each per token")
    _check_pair(src, dst, rope)
    if src_slots.numel() == 0:
        return
    device = dst.key.device
    uniq, seg = torch.unique(deltas.cpu(), return_inverse=True)
    cos, sin = rope.cos_sin(uniq, device)
    _backend(backend, device)(src, dst, src_slots.to(device), dst_slots.to(device),
                              seg.to(device, torch.int32), cos, sin, rope)


def evict_spans(layers: PagedKV | Sequence[PagedKV], src_block_table: torch.Tensor, src_len: int,
                spans: Sequence[Span], dst_block_table: torch.Tensor, rope: RopeParams,
                replacement: Sequence[PagedKV] | None = None, dst_layers: Sequence[PagedKV] | None = None,
                backend: Backend = "auto") -> EvictionPlan:
    """Drop ``spans`` of a cached sequence; write kept tokens (and supplied replacement rows) to
    ``dst_block_table``. Keys move from old position ``p`` to new ``q`` by rotating ``q - p``.

    ``replacement[i]``: the i-th layer's K/V rows for all spans' replacement tokens, in order,
    already rotated at their new positions (``PagedKV.from_rows``). Without it, those slots are
    left for the engine to compute. Returns the plan (moved token count, new length, positions).
    """
    layers = [layers] if isinstance(layers, PagedKV) else list(layers)
    block = layers[0].block_size
    dsts = list(dst_layers) if dst_layers else layers
    in_one_cache = all(_same_cache(s, d) for s, d in zip(layers, dsts))
    plan = build_plan(src_len, spans, src_block_table, dst_block_table, block, dsts[0].block_size,
                      skip_unmoved=in_one_cache)
    if replacement is not None and any(r.key.shape[0] != plan.replacement_slots.numel() for r in replacement):
        raise ValueError(f"replacement rows must number {plan.replacement_slots.numel()} per layer")
    apply_plan(layers, plan, rope, replacement, dst_layers, backend)
    return plan
