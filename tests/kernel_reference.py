"""An oracle for the eviction kernels that shares no code with them.

Rotation: transformers' own functions, Llama's ``apply_rotary_pos_emb`` (``rotate_half``, NeoX
pairs) and GPT-J's (``rotate_every_two``, interleaved pairs), in float64, rotary dims first and the
rest passed through as those models do. Moves: positions and slots recomputed here with plain Python
from the spans (not ``build_plan``). Expected caches are whole buffers: everything the kernel must
not touch keeps its bytes.
"""

from __future__ import annotations

import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary

from agentkv.kernels import PagedKV, RopeParams, Span


def hf_rotate(x: torch.Tensor, deltas: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    """``x [n, heads, head_dim]`` rotated by ``deltas[i]`` positions, with transformers' RoPE code."""
    rot = rope.rotary_dim
    x64 = x.to(torch.float64)
    freqs = deltas.to(torch.float64)[:, None] * rope.inv_freq.to(torch.float64)[None, :]   # [n, rot/2]
    x_rot, x_pass = x64[..., :rot], x64[..., rot:]
    if rope.is_neox:
        emb = torch.cat([freqs, freqs], dim=-1)[None]                                   # [1, n, rot]
        t = x_rot.transpose(0, 1)[None]                                                 # [1, heads, n, rot]
        _, k = llama_apply_rotary(t, t, emb.cos(), emb.sin())
        rotated = k[0].transpose(0, 1)                                                  # [n, heads, rot]
    else:
        rotated = gptj_apply_rotary(x_rot[None], freqs.sin()[None], freqs.cos()[None])[0]
    return torch.cat([rotated, x_pass], dim=-1)


def slot(block_table: torch.Tensor, position: int, block_size: int) -> int:
    return int(block_table[position // block_size]) * block_size + position % block_size


def expected_moves(src_len: int, spans: list[Span], src_bt, dst_bt, src_bs: int, dst_bs: int):
    """``[(src_slot, dst_slot, delta)]`` for kept tokens and ``[dst_slot]`` for replacement rows, in order."""
    spans = sorted(spans, key=lambda s: s.start)
    moves, replacement_slots, shift = [], [], 0
    p = 0
    for s in spans + [Span(src_len, src_len)]:
        for q in range(p, s.start):
            moves.append((slot(src_bt, q, src_bs), slot(dst_bt, q + shift, dst_bs), shift))
        replacement_slots += [slot(dst_bt, s.start + shift + j, dst_bs) for j in range(s.replacement)]
        shift += s.replacement - (s.end - s.start)
        p = s.end
    return moves, replacement_slots


def write_expected(src: PagedKV, dst: PagedKV, moves, rope: RopeParams,
                   replacement: PagedKV | None = None, replacement_slots=()) -> None:
    """Apply ``moves`` from ``src`` (an untouched copy of the source) into ``dst`` (a copy of the
    destination's starting bytes), with the reference rotation; then the replacement rows."""
    if moves:
        s, d, delta = (torch.tensor(c, dtype=torch.int64) for c in zip(*moves))
        k = src.key[s // src.block_size, s % src.block_size]
        dst.key[d // dst.block_size, d % dst.block_size] = hf_rotate(k, delta, rope).to(dst.key.dtype)
        dst.value[d // dst.block_size, d % dst.block_size] = src.value[s // src.block_size, s % src.block_size]
    if replacement_slots:
        r = torch.tensor(list(replacement_slots), dtype=torch.int64)
        dst.key[r // dst.block_size, r % dst.block_size] = replacement.key[:, 0]
        dst.value[r // dst.block_size, r % dst.block_size] = replacement.value[:, 0]
