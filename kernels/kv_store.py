"""Worker-side store of saved prompt KV: per key, the prompt's token ids and every layer's K/V rows.

Rows are dense ``[n_tokens, kv_heads, head_dim]`` copies taken from the paged cache right after
the prompt's prefill, so a later request can move them even after vLLM reuses the blocks. Bounded
in bytes; the least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .layout import PagedKV


@dataclass
class SavedPrompt:
    token_ids: list[int]
    layers: dict[str, PagedKV] = field(default_factory=dict)   # PagedKV.from_rows per layer

    @property
    def nbytes(self) -> int:
        return sum(kv.key.numel() * kv.key.element_size() * 2 for kv in self.layers.values())


class KVStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SavedPrompt] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> SavedPrompt | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def begin(self, key: str, token_ids: list[int]) -> SavedPrompt:
        entry = SavedPrompt(list(token_ids))
        self._entries[key] = entry
        self._entries.move_to_end(key)
        return entry

    def save_layer(self, entry: SavedPrompt, layer: str, cache: PagedKV, slots: torch.Tensor) -> None:
        b, o = slots // cache.block_size, slots % cache.block_size
        entry.layers[layer] = PagedKV.from_rows(cache.key[b, o].clone(), cache.value[b, o].clone())
        self._evict()

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        while total > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            total -= old.nbytes
