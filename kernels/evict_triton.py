"""Triton kernel for the copy-and-rotate step, and its launcher."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import PagedKV
from .rope import RopeParams


@triton.jit
def _copy_rotate_kernel(
    src_k_ptr, src_v_ptr,        # [src_blocks, SRC_BS, heads, head_dim], strides s_* (K), sv_* (V)
    dst_k_ptr, dst_v_ptr,        # [dst_blocks, DST_BS, heads, head_dim], strides d_* (K), dv_* (V)
    src_slot_ptr, dst_slot_ptr,  # [n_tokens] int64
    seg_ptr,                     # [n_tokens] int32, row of cos/sin
    cos_ptr, sin_ptr,            # [n_segments, ROT_HALF] float32, contiguous
    num_heads,
    s_b, s_s, s_h, s_d,
    d_b, d_s, d_h, d_d,
    sv_b, sv_s, sv_h, sv_d,
    dv_b, dv_s, dv_h, dv_d,
    SRC_BS: tl.constexpr, DST_BS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, ROTATE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    tok = tl.program_id(0)
    src_slot = tl.load(src_slot_ptr + tok)
    dst_slot = tl.load(dst_slot_ptr + tok)
    src_base = (src_slot // SRC_BS) * s_b + (src_slot % SRC_BS) * s_s
    dst_base = (dst_slot // DST_BS) * d_b + (dst_slot % DST_BS) * d_s
    src_vbase = (src_slot // SRC_BS) * sv_b + (src_slot % SRC_BS) * sv_s
    dst_vbase = (dst_slot // DST_BS) * dv_b + (dst_slot % DST_BS) * dv_s

    h = tl.arange(0, BLOCK_H)[:, None]
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)[None, :]
    full = h_ok & (d < HEAD_DIM)
    v = tl.load(src_v_ptr + src_vbase + h * sv_h + d * sv_d, mask=full)
    tl.store(dst_v_ptr + dst_vbase + h * dv_h + d * dv_d, v, mask=full)

    if ROTATE:
        seg = tl.load(seg_ptr + tok)
        r = tl.arange(0, BLOCK_R)[None, :]
        r_ok = r < ROT_HALF
        cos = tl.load(cos_ptr + seg * ROT_HALF + r, mask=r_ok, other=1.0)
        sin = tl.load(sin_ptr + seg * ROT_HALF + r, mask=r_ok, other=0.0)
        if IS_NEOX:
            i1 = r
            i2 = r + ROT_HALF
        else:
            i1 = 2 * r
            i2 = 2 * r + 1
        m = h_ok & r_ok
        x1 = tl.load(src_k_ptr + src_base + h * s_h + i1 * s_d, mask=m).to(tl.float32)
        x2 = tl.load(src_k_ptr + src_base + h * s_h + i2 * s_d, mask=m).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        out_ty = dst_k_ptr.dtype.element_ty
        tl.store(dst_k_ptr + dst_base + h * d_h + i1 * d_d, y1.to(out_ty), mask=m)
        tl.store(dst_k_ptr + dst_base + h * d_h + i2 * d_d, y2.to(out_ty), mask=m)
        p = 2 * ROT_HALF + tl.arange(0, BLOCK_P)[None, :]   # dims past rotary_dim pass through
        pm = h_ok & (p < HEAD_DIM)
        kp = tl.load(src_k_ptr + src_base + h * s_h + p * s_d, mask=pm)
        tl.store(dst_k_ptr + dst_base + h * d_h + p * d_d, kp, mask=pm)
    else:
        k = tl.load(src_k_ptr + src_base + h * s_h + d * s_d, mask=full)
        tl.store(dst_k_ptr + dst_base + h * d_h + d * d_d, k, mask=full)


def copy_rotate_triton(src: PagedKV, dst: PagedKV, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                       seg: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rope: RopeParams | None) -> None:
    """Same contract as ``copy_rotate_torch``; one program per moved token, all heads at once."""
    n = src_slots.numel()
    if n == 0:
        return
    heads, head_dim = src.num_kv_heads, src.head_dim
    rot_half = rope.rotary_dim // 2 if rope is not None else 1
    _copy_rotate_kernel[(n,)](
        src.key, src.value, dst.key, dst.value,
        src_slots.contiguous(), dst_slots.contiguous(), seg.to(torch.int32).contiguous(),
        cos.contiguous(), sin.contiguous(),
        heads,
        *src.key.stride(), *dst.key.stride(), *src.value.stride(), *dst.value.stride(),
        SRC_BS=src.block_size, DST_BS=dst.block_size,
        HEAD_DIM=head_dim, ROT_HALF=rot_half,
        IS_NEOX=bool(rope.is_neox) if rope is not None else True, ROTATE=rope is not None,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(1, head_dim - 2 * rot_half)),
    )
