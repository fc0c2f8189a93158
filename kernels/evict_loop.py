"""Per-token loop: the plainest statement of the copy-and-rotate step (test oracle, benchmark baseline).

It shares no rotation code with ``rope.rotate`` (the torch path) or the Triton kernel: each rotary
pair is one complex number, multiplied by ``cos + i sin``. NeoX pairs are ``x[j] + i x[j + rot/2]``;
GPT-J pairs are ``x[2j] + i x[2j+1]``, i.e. ``view_as_complex`` of the rotary dims.
"""

from __future__ import annotations

import torch

from .layout import PagedKV
from .rope import RopeParams


def rotate_complex(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    """``k [..., head_dim]`` rotated by angles with ``cos, sin [rotary_dim/2]``, in float64 complex."""
    rot, half = rope.rotary_dim, rope.rotary_dim // 2
    x = k.to(torch.float64)
    turn = torch.complex(cos.to(torch.float64), sin.to(torch.float64))
    if rope.is_neox:
        z = torch.complex(x[..., :half], x[..., half:rot]) * turn
        rotated = torch.cat([z.real, z.imag], dim=-1)
    else:
        z = torch.view_as_complex(x[..., :rot].reshape(*x.shape[:-1], half, 2).contiguous()) * turn
        rotated = torch.view_as_real(z).flatten(-2)
    return torch.cat([rotated, x[..., rot:]], dim=-1).to(k.dtype)


def copy_rotate_loop(src: PagedKV, dst: PagedKV, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     seg: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rope: RopeParams | None) -> None:
    """Same contract as ``copy_rotate_torch``: every move reads before any writes (staged)."""
    staged = []
    for s, g in zip(src_slots.tolist(), seg.tolist()):
        k = src.key[s // src.block_size, s % src.block_size]       # [heads, head_dim]
        v = src.value[s // src.block_size, s % src.block_size].clone()
        staged.append((rotate_complex(k, cos[g], sin[g], rope) if rope is not None else k.clone(), v))
    for d, (k, v) in zip(dst_slots.tolist(), staged):
        dst.key[d // dst.block_size, d % dst.block_size] = k.to(dst.key.dtype)
        dst.value[d // dst.block_size, d % dst.block_size] = v.to(dst.value.dtype)
