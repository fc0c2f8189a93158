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


# Rotary pairing per transformers ``model_type``: True = NeoX halves ``(x[i], x[i + rot/2])``,
# False = GPT-J interleaved pairs ``(x[2i], x[2i+1])``. vLLM 0.32 has no per-config flag for this:
# each model file passes ``is_neox_style`` to ``get_rope`` (default True), and architectures it
# serves through its transformers backend (glm, gpt_neox, olmo, olmo2, phi, seed_oss, starcoder2,
# arcee) rotate with transformers' code (``rotate_half`` halves; ``x[..., ::2]`` pairs in glm, glm4,
# cohere, ernie4_5). tests/kernels/test_rope.py checks every entry against transformers' own model.
# gptj/codegen and chatglm are handled apart (no rope parameters in their configs). Not listed, so
# refused: no RoPE (gpt2, bloom, opt, mpt), NoPE layers (llama4, smollm3, cohere2), multimodal
# positions (qwen2_vl, ...). transformers 5.19's one pairing flag, ``rope_interleave``, exists only
# on MLA configs (refused below) and is not what vLLM rotates their keys by.
PAIRING: dict[str, bool] = {
    **dict.fromkeys(["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                     "granite", "granitemoe", "phi3", "phi", "stablelm", "gpt_neox", "olmo", "olmo2",
                     "olmoe", "nemotron", "starcoder2", "glm4_moe", "falcon", "seed_oss", "arcee"], True),
    **dict.fromkeys(["glm", "glm4", "cohere", "ernie4_5", "ernie4_5_moe"], False),
}


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
    def from_hf_config(cls, config) -> RopeParams:
        """RoPE of a transformers config: the pairing from its architecture (``PAIRING``), inv_freq
        from transformers' own RoPE functions.

        Raises UnsupportedShift where a shift cannot be exact or the pairing is not known: an
        architecture not in ``PAIRING`` (no RoPE, NoPE layers, multimodal positions, ...),
        position-dependent scaling (dynamic NTK, LongRoPE), MLA latent caches, sliding-window layers.
        """
        model_type = getattr(config, "model_type", None)
        if getattr(config, "kv_lora_rank", None):
            raise UnsupportedShift("MLA latent KV cache: the rotary part is not a plain key rotation")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise UnsupportedShift("sliding-window attention layers")
        if model_type in ("gptj", "codegen"):
            return cls._gptj(config)
        if model_type == "chatglm":
            return cls._chatglm(config)
        if model_type not in PAIRING:
            raise UnsupportedShift(f"model_type {model_type!r}: rotary pairing not known for this architecture")
        if getattr(config, "alibi", False):
            raise UnsupportedShift("ALiBi positions (no rotary embedding)")
        is_neox = PAIRING[model_type]
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

    @classmethod
    def _gptj(cls, config) -> RopeParams:
        """GPT-J and CodeGen: interleaved pairs over the first ``rotary_dim`` dims, theta 10000 (their
        configs carry no rope parameters; transformers' ``create_sinusoidal_positions``, vLLM's gpt_j)."""
        return cls.default(config.n_embd // config.n_head, 10000.0, config.rotary_dim, is_neox=False)

    @classmethod
    def _chatglm(cls, config) -> RopeParams:
        """ChatGLM / GLM-4 remote-code configs, as vLLM's chatglm builds them: rotary on half the head,
        theta ``10000 * rope_ratio``, interleaved pairs unless ``original_rope`` is false."""
        original_rope = getattr(config, "original_rope", None)
        if original_rope is None:
            raise UnsupportedShift("chatglm config without original_rope: rotary pairing not known")
        head_dim = config.hidden_size // config.num_attention_heads
        return cls.default(head_dim, 10000.0 * getattr(config, "rope_ratio", 1.0), head_dim // 2,
                           is_neox=not original_rope)

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


