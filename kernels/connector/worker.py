"""Worker side of the connector: move tokens between blocks of vLLM's own KV tensors.

Each worker (one per tensor-parallel rank) holds views of the KV tensors vLLM registered — its own
shard of the heads — and nothing else: no K/V of its own. A load copies every run's tokens from
held blocks into the new request's blocks, layer by layer, rotating keys by the run's position
delta (``move_tokens``). Sources are blocks the scheduler side holds; destinations are blocks vLLM
just allocated for the request; the two never overlap. Also here: whether this engine's model and
KV layout can be shifted at all (asked by both sides from the config alone).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from agentkv.kernels.evict import move_tokens
from agentkv.kernels.layout import PagedKV, slots_of
from agentkv.kernels.rope import RopeParams, UnsupportedShift

log = logging.getLogger("vllm.agentkv_connector")   # in the engine process, under vLLM's log handlers
FAULT_ENV = "AGENTKV_FAULT_KV_LOAD"   # tests: "1" makes every load fail (vLLM then recomputes)


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: runs ``(source, src_start, dst_start, length)`` from ``sources[source]``
    (block tables of held prompts) into ``dst_blocks`` (the request's own block table)."""

    req_id: str
    dst_blocks: list[int]
    sources: list[list[int]]
    runs: list[tuple[int, int, int, int]]

    def dst_block_ids(self, block_size: int) -> set[int]:
        """The request's blocks this load writes (reported as failed if it cannot)."""
        out = set()
        for _, _, d, n in self.runs:
            out.update(self.dst_blocks[d // block_size:(d + n - 1) // block_size + 1])
        return out


def check_support(vllm_config) -> tuple[RopeParams | None, str | None]:
    """(RoPE parameters, None) when keys of this model can be re-rotated in this KV layout, else
    (None, why). Config only, so the scheduler side refuses before it claims anything."""
    try:
        rope = RopeParams.from_hf_config(vllm_config.model_config.hf_config)
    except (UnsupportedShift, AttributeError, KeyError) as exc:
        return None, f"model: {exc}"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype.startswith("fp8"):
        return None, "fp8 KV cache (rotating it needs its scales)"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(vllm_config.model_config.dtype, vllm_config.cache_config.block_size,
                                vllm_config.model_config.get_head_size(), cache_dtype)
        except (ImportError, TypeError, NotImplementedError) as exc:
            return None, f"CPU attention kernel unknown ({exc})"
        if isa != "vec":
            return None, f"CPU attention ISA {isa!r} packs K/V in a layout this connector does not read"
    return rope, None


def geometry_problem(caches: dict[str, PagedKV], block_size: int, rope: RopeParams | None) -> str | None:
    """Why these KV tensors cannot be moved in as the scheduler's block ids address them, or None.
    Block ids are the scheduler's (``block_size`` tokens each): a tensor whose blocks are of another
    size (vLLM splits a scheduler block into smaller kernel blocks for some attention backends, and
    with decode context parallelism) would take moved tokens into other requests' slots."""
    if not caches:
        return "no KV cache layers registered"
    for name, cache in caches.items():
        if cache.block_size != block_size:
            return (f"layer {name}: KV tensor blocks hold {cache.block_size} tokens, the scheduler's "
                    f"{block_size}")
        if rope is not None and cache.head_dim != rope.head_dim:
            return f"layer {name}: KV head_dim {cache.head_dim}, the model's RoPE head_dim {rope.head_dim}"
    blocks = {c.key.shape[0] for c in caches.values()}
    if len(blocks) != 1:
        return f"layers hold different numbers of blocks ({sorted(blocks)})"
    return None


class KVMover:
    """Called by the worker-side connector only, from the model runner's thread. ``block_size``:
    the scheduler's (what the block ids in a load count in)."""

    def __init__(self, rope: RopeParams | None, block_size: int):
        self.rope, self.block_size = rope, block_size
        self.caches: dict[str, PagedKV] = {}
        self.problem: str | None = None
        self.fail_all = os.environ.get(FAULT_ENV) == "1"

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views of vLLM's per-layer KV tensors (no copies), checked: every layer one ``PagedKV`` of
        the scheduler's block size and the model's head_dim. What is not turns moving off
        (``problem``, which the scheduler side learns at start-up and reports as ``geometry``)."""
        try:
            self.caches = {name: PagedKV.from_vllm(t) for name, t in kv_caches.items()}
            self.problem = geometry_problem(self.caches, self.block_size, self.rope)
        except ValueError as exc:
            self.caches, self.problem = {}, f"KV layout: {exc}"
        if self.problem:
            log.warning("agentkv connector: %s; moving disabled, every edit recomputes", self.problem)
            self.caches = {}
        first = next(iter(kv_caches.items()), None)
        log.info("agentkv connector: %d KV layers on this worker, e.g. %s %s", len(kv_caches),
                 *((first[0], tuple(first[1].shape)) if first else ("-", ())))

    def load(self, loads: list[LoadSpec]) -> set[int]:
        """Run the loads before the forward pass; returns the block ids of loads that failed."""
        failed: set[int] = set()
        for spec in loads:
            try:
                if self.fail_all or self.rope is None or not self.caches:
                    raise RuntimeError("moving is disabled on this worker" if not self.fail_all
                                       else f"{FAULT_ENV}=1")
                self._move(spec, self.rope)
            except (RuntimeError, ValueError, IndexError) as exc:
                log.warning("agentkv connector: load for %s failed (%s); vLLM recomputes it", spec.req_id, exc)
                failed |= spec.dst_block_ids(self.block_size)
        return failed

    def _move(self, spec: LoadSpec, rope: RopeParams) -> None:
        by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for cache in self.caches.values():   # every layer's blocks are the scheduler's (``register``)
            device = cache.key.device
            if device not in by_device:
                by_device[device] = self._slots(spec, self.block_size, device)
            src, dst, deltas = by_device[device]
            move_tokens(cache, cache, src, dst, deltas, rope)

    @staticmethod
    def _slots(spec: LoadSpec, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src, dst, deltas = [], [], []
        dst_table = torch.tensor(spec.dst_blocks, dtype=torch.int64)
        for source, a, d, n in spec.runs:
            table = torch.tensor(spec.sources[source], dtype=torch.int64)
            src.append(slots_of(torch.arange(a, a + n), table, block_size))
            dst.append(slots_of(torch.arange(d, d + n), dst_table, block_size))
            deltas.append(torch.full((n,), d - a, dtype=torch.int64))
        return torch.cat(src).to(device), torch.cat(dst).to(device), torch.cat(deltas)
