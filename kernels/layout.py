"""Views of vLLM's paged KV caches as ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors.

Kernels address K and V only through these views' strides, so any layout that can be viewed this
way works without a copy. Two are provided: vLLM's CUDA flash-attention layout and its CPU layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    """One layer's key and value caches, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (any strides; K and V may differ)."""

    key: torch.Tensor
    value: torch.Tensor

    def __post_init__(self) -> None:
        if self.key.dim() != 4 or self.key.shape != self.value.shape:
            raise ValueError(f"key/value must be equal 4-D views, got {tuple(self.key.shape)} and "
                             f"{tuple(self.value.shape)}")
        if self.key.dtype != self.value.dtype or self.key.device != self.value.device:
            raise ValueError("key and value must share dtype and device")

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    @classmethod
    def from_flash(cls, kv_cache: torch.Tensor) -> PagedKV:
        """vLLM FlashAttention: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"expected [2, blocks, block_size, heads, head_dim], got {tuple(kv_cache.shape)}")
        return cls(kv_cache[0], kv_cache[1])

    @classmethod
    def from_cpu(cls, kv_cache: torch.Tensor) -> PagedKV:
        """vLLM CPU attention (its portable ``vec`` kernels): ``[num_blocks, num_kv_heads,
        block_size, 2 * head_dim]`` storage; per block and head, the first ``block_size * head_dim``
        elements hold K transposed (``[head_dim, block_size]``), the next V as rows
        (``[block_size, head_dim]``). Checked against K/V computed by transformers."""
        if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
            raise ValueError(f"expected [blocks, heads, block_size, 2*head_dim], got {tuple(kv_cache.shape)}")
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        key = kv_cache.view(nb, h, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2)     # [nb, bs, h, d]
        value = kv_cache.view(nb, h, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3)   # [nb, bs, h, d]
        return cls(key, value)

    @classmethod
    def from_vllm(cls, kv_layer: torch.Tensor, layout: str | None = None) -> PagedKV:
        """The layer tensor vLLM registers: 4-D is the CPU layout; 5-D with a leading 2 is
        FlashAttention's ``[2, blocks, ...]``; 5-D with 2 second is ``[blocks, 2, ...]``.
        ``layout`` (``layout_of`` of the tensor vLLM registered) reads a tensor of the same layout
        whose block count could be mistaken for the 2 (a copy of 2 blocks)."""
        layout = layout or layout_of(kv_layer)
        if layout == "cpu":
            return cls.from_cpu(kv_layer)
        if layout == "flash":
            return cls.from_flash(kv_layer)
        return cls(kv_layer[:, 0], kv_layer[:, 1])

    @classmethod
    def from_rows(cls, key: torch.Tensor, value: torch.Tensor) -> PagedKV:
        """Dense ``[n, num_kv_heads, head_dim]`` rows as a cache of n one-slot blocks (slot i = row i)."""
        return cls(key.unsqueeze(1), value.unsqueeze(1))


def layout_of(kv_layer: torch.Tensor) -> str:
    """Which of ``PagedKV.from_vllm``'s layouts a layer tensor vLLM registers has: ``cpu``,
    ``flash`` (``[2, blocks, ...]``) or ``blocks_first`` (``[blocks, 2, ...]``)."""
    if kv_layer.dim() == 4:
        return "cpu"
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2:
        return "flash"
    if kv_layer.dim() == 5 and kv_layer.shape[1] == 2:
        return "blocks_first"
    raise ValueError(f"unknown KV cache layout {tuple(kv_layer.shape)}")


def block_dim(layout: str) -> int:
    """The dimension that counts the blocks in a ``layout_of`` layout: 1 in FlashAttention's, else 0."""
    return 1 if layout == "flash" else 0


def slots_of(positions: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot ids (``block * block_size + offset``) of token ``positions`` under ``block_table``."""
    blocks = block_table.to(positions.device, torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
