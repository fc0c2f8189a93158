"""RoPE parameters for re-rotating cached keys by a position delta.

A cached key was rotated by angle ``p * inv_freq``; moving it to position ``q`` multiplies it by the
pure rotation ``(q - p) * inv_freq``. Magnitude scaling (YaRN's attention factor) is already in the
cached key and is never applied again. The rotation table is built per distinct delta in float64,
then rounded once to float32, so angle error does not grow with the delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedShift(ValueError):
    """A position shift cannot be exact for this model; the caller must recompute instead."""


@dataclass(frozen=True)
class RopeParams:
    """inv_freq: float32 ``[rotary_dim // 2]``; dims from ``rotary_dim`` on are not rotated.

    is_neox: pairs are ``(x[i], x[i + rotary_dim/2])`` (Llama, Qwen, Mistral); otherwise GPT-J style
    interleaved pairs ``(x[2i], x[2i+1])``.
    """

    inv_freq: torch.Tensor
    head_dim: int
    is_neox: bool = True

    def __post_init__(self) -> None:
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def default(cls, head_dim: int, theta: float = 10000.0, rotary_dim: int | None = None,
                is_neox: bool = True, linear_factor: float = 1.0) -> RopeParams:
        """Plain RoPE (optionally linear-scaled), computed as transformers and vLLM compute it."""
        dim = rotary_dim or head_dim
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return cls(inv / linear_factor, head_dim, is_neox)

    @classmethod
    def from_hf_config(cls, config, is_neox: bool = True) -> RopeParams:
        """RoPE of a transformers config; inv_freq comes from transformers' own RoPE functions.

        Raises UnsupportedShift where a shift cannot be exact: position-dependent scaling
        (dynamic NTK, LongRoPE), MLA latent caches, sliding-window layers.
        """
        if getattr(config, "kv_lora_rank", None):
            raise UnsupportedShift("MLA latent KV cache: the rotary part is not a plain key rotation")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise UnsupportedShift("sliding-window attention layers")
        config.standardize_rope_params()
        params = dict(config.rope_parameters)
        rope_type = params.get("rope_type", "default")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            return cls.default(head_dim, params["rope_theta"], rotary_dim, is_neox)
        if rope_type in ("linear", "llama3", "yarn"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, _attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
            return cls(inv_freq.float(), head_dim, is_neox)
        raise UnsupportedShift(f"rope_type {rope_type!r} depends on the sequence length")

    def cos_sin(self, deltas: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[len(deltas), rotary_dim // 2]`` cos and sin of ``delta * inv_freq``."""
        angles = deltas.to(torch.float64).reshape(-1, 1).cpu() * self.inv_freq.to(torch.float64).reshape(1, -1)
        return torch.cos(angles).float().to(device), torch.sin(angles).float().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    """Rotate ``x [..., head_dim]`` by angles with ``cos, sin [..., rotary_dim/2]`` (float32 math)."""
    rot, half = rope.rotary_dim, rope.rotary_dim // 2
    out = x.to(torch.float32, copy=True)
    if rope.is_neox:
        x1, x2 = out[..., :half], out[..., half:rot]
    else:
        x1, x2 = out[..., 0:rot:2], out[..., 1:rot:2]
    y1 = (x1 * cos).addcmul_(x2, sin, value=-1.0)   # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(x1, sin)                  # x2 cos + x1 sin, in place (x1 still intact)
    x1.copy_(y1)
    return out.to(x.dtype)


def apply_rope_at(x: torch.Tensor, positions: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    """Rotate un-rotated ``x [n, heads, head_dim]`` to absolute ``positions [n]`` (tests, references)."""
    cos, sin = rope.cos_sin(positions, x.device)
    return rotate(x, cos[:, None, :], sin[:, None, :], rope)


