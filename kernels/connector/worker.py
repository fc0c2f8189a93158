"""Worker side of the connector: move tokens between blocks of vLLM's own KV tensors.

Each worker (one per tensor-parallel rank) holds views of the KV tensors vLLM registered — its own
shard of the heads — and, once the scheduler side spills, the host tier's tensors (``HostStore``:
the same layout, in host memory, pinned beside a GPU). A step first runs its spills (copies of
held blocks vLLM handed out in that step, into host blocks), then its loads: every run's tokens
from held blocks, in the pool or in the host tier, into the new request's blocks, layer by layer,
rotating keys by the run's position delta (``move_tokens``). Destinations are blocks vLLM just
allocated for the request; sources never overlap them. Also here: whether this engine's model and
KV layout can be shifted at all (asked by both sides from the config alone).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from agentkv.kernels.evict import move_tokens
from agentkv.kernels.layout import PagedKV, block_dim, layout_of, slots_of
from agentkv.kernels.rope import RopeParams, UnsupportedShift

log = logging.getLogger("vllm.agentkv_connector")   # in the engine process, under vLLM's log handlers
FAULT_ENV = "AGENTKV_FAULT_KV_LOAD"   # tests: "1" makes every load fail (vLLM then recomputes)


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: runs ``(source, src_start, dst_start, length)`` from ``sources[source]``
    (block tables of held prompts: in vLLM's pool, or in the host tier where ``on_host[source]``)
    into ``dst_blocks`` (the request's own block table)."""

    req_id: str
    dst_blocks: list[int]
    sources: list[list[int]]
    runs: list[tuple[int, int, int, int]]
    on_host: list[bool] = field(default_factory=list)

    def from_host(self, source: int) -> bool:
        return source < len(self.on_host) and self.on_host[source]

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


class HostStore:
    """The host tier's K/V on one worker: per layer, a tensor laid out like vLLM's with ``blocks``
    blocks, in host memory (pinned when vLLM's is on a GPU: allocated at start-up, so a tier that
    cannot be had fails there, not mid-serving)."""

    def __init__(self, blocks: int, layers: dict[str, torch.Tensor]):
        pin = any(t.is_cuda for t in layers.values()) and torch.cuda.is_available()
        self.layouts = {name: layout_of(t) for name, t in layers.items()}
        self.raw: dict[str, torch.Tensor] = {}
        for name, t in layers.items():
            shape = list(t.shape)
            shape[block_dim(self.layouts[name])] = blocks
            self.raw[name] = torch.empty(shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        self.caches = {name: PagedKV.from_vllm(t, self.layouts[name]) for name, t in self.raw.items()}
        self.blocks = blocks
        log.info("agentkv connector: host tier of %d blocks allocated (%.2f GiB%s)", blocks,
                 sum(t.numel() * t.element_size() for t in self.raw.values()) / 2**30, ", pinned" if pin else "")

    def spill(self, layers: dict[str, torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host blocks, ``(device block, host block)`` each, every layer."""
        dev = torch.tensor([d for d, _ in pairs], dtype=torch.int64)
        host = torch.tensor([h for _, h in pairs], dtype=torch.int64)
        for name, t in layers.items():
            dim = block_dim(self.layouts[name])
            self.raw[name].index_copy_(dim, host, t.index_select(dim, dev.to(t.device)).to("cpu"))

    def source(self, name: str, device: torch.device, blocks: list[int]) -> tuple[PagedKV, list[int]]:
        """Layer ``name``'s host K/V readable on ``device``, and ``blocks`` as addressed there: the
        host tensor itself when it is on that device, else those blocks staged there in order."""
        host, layout = self.raw[name], self.layouts[name]
        if device == host.device:
            return self.caches[name], blocks
        index = torch.tensor(blocks, dtype=torch.int64)
        staged = host.index_select(block_dim(layout), index).to(device, non_blocking=True)
        return PagedKV.from_vllm(staged, layout), list(range(len(blocks)))


@dataclass
class RestoreStats:
    """What one worker measured of restores (loads reading the host tier) since the last report;
    vLLM sums the workers' (the restores themselves are counted once, by the scheduler side)."""

    restore_bytes: int = 0
    restore_seconds: float = 0.0

    def take(self) -> dict[str, float]:
        out = {"restore_bytes": self.restore_bytes, "restore_seconds": self.restore_seconds}
        self.restore_bytes, self.restore_seconds = 0, 0.0
        return out


class KVMover:
    """Called by the worker-side connector only, from the model runner's thread. ``block_size``:
    the scheduler's (what the block ids in a load count in)."""

    def __init__(self, rope: RopeParams | None, block_size: int, host_blocks: int = 0):
        self.rope, self.block_size, self.host_blocks = rope, block_size, host_blocks
        self.caches: dict[str, PagedKV] = {}
        self.layers: dict[str, torch.Tensor] = {}
        self.host: HostStore | None = None
        self.host_lost: str | None = None      # why this worker's tier is gone for good (its copies are)
        self.restored = RestoreStats()
        self.problem: str | None = None
        self.fail_all = os.environ.get(FAULT_ENV) == "1"

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views of vLLM's per-layer KV tensors (no copies), checked: every layer one ``PagedKV`` of
        the scheduler's block size and the model's head_dim. What is not turns moving off
        (``problem``, which the scheduler side learns at start-up and reports as ``geometry``)."""
        try:
            self.caches = {name: PagedKV.from_vllm(t) for name, t in kv_caches.items()}
            self.layers = dict(kv_caches)
            self.problem = geometry_problem(self.caches, self.block_size, self.rope)
        except ValueError as exc:
            self.caches, self.problem = {}, f"KV layout: {exc}"
        if self.problem:
            log.warning("agentkv connector: %s; moving disabled, every edit recomputes", self.problem)
            self.caches, self.layers = {}, {}
        elif self.host_blocks > 0:
            try:
                self.host = HostStore(self.host_blocks, self.layers)
            except (RuntimeError, ValueError) as exc:   # pinned memory refused: held blocks evicted are lost
                self._lose_host(f"allocating {self.host_blocks} blocks failed ({exc})")
        first = next(iter(kv_caches.items()), None)
        log.info("agentkv connector: %d KV layers on this worker, e.g. %s %s", len(kv_caches),
                 *((first[0], tuple(first[1].shape)) if first else ("-", ())))

    def spill(self, pairs: list[tuple[int, int]], host_blocks: int) -> None:
        """Copy held blocks vLLM handed out this step into the host tier (before this step's loads
        and forward pass write them). A spill that cannot be made leaves the tier's copies wrong:
        the tier is gone for good on this worker, and every later read of it fails (vLLM recomputes)."""
        if not pairs or self.host is None:
            return
        if host_blocks != self.host.blocks:
            self._lose_host(f"the scheduler's tier has {host_blocks} blocks, this worker's {self.host.blocks}")
            return
        try:
            self.host.spill(self.layers, pairs)
        except (RuntimeError, ValueError, IndexError) as exc:
            self._lose_host(f"spilling {len(pairs)} blocks failed ({exc})")

    def _lose_host(self, why: str) -> None:
        log.warning("agentkv connector: host tier off on this worker: %s; its reads recompute", why)
        self.host, self.host_lost = None, why

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
        pooled = [r for r in spec.runs if not spec.from_host(r[0])]
        hosted = [r for r in spec.runs if spec.from_host(r[0])]
        if hosted and self.host is None:
            raise RuntimeError(f"no host tier on this worker ({self.host_lost or 'none configured'})")
        if pooled:
            by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            for cache in self.caches.values():   # every layer's blocks are the scheduler's (``register``)
                device = cache.key.device
                if device not in by_device:
                    by_device[device] = self._slots(spec.sources, pooled, spec.dst_blocks, self.block_size, device)
                move_tokens(cache, cache, *by_device[device], rope)
        if hosted:
            self._restore(spec, hosted, rope)

    def _restore(self, spec: LoadSpec, runs: list[tuple[int, int, int, int]], rope: RopeParams) -> None:
        """The runs whose source is in the host tier, into vLLM's blocks (staged on the device
        first where vLLM's are on another one), timed."""
        assert self.host is not None
        bs = self.block_size
        used = sorted({spec.sources[src][b] for src, a, _, n in runs for b in range(a // bs, (a + n - 1) // bs + 1)})
        started = time.perf_counter()
        for name, cache in self.caches.items():
            host, staged = self.host.source(name, cache.key.device, used)
            where = dict(zip(used, staged, strict=True))
            sources = [[where.get(b, -1) for b in table] for table in spec.sources]
            move_tokens(host, cache, *self._slots(sources, runs, spec.dst_blocks, bs, cache.key.device), rope)
        if any(c.key.is_cuda for c in self.caches.values()):
            torch.cuda.synchronize()
        self.restored.restore_seconds += time.perf_counter() - started
        self.restored.restore_bytes += sum(r[3] for r in runs) * sum(
            2 * c.num_kv_heads * c.head_dim * c.key.element_size() for c in self.caches.values())

    @staticmethod
    def _slots(sources: list[list[int]], runs: list[tuple[int, int, int, int]], dst_blocks: list[int],
               block_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src, dst, deltas = [], [], []
        dst_table = torch.tensor(dst_blocks, dtype=torch.int64)
        for source, a, d, n in runs:
            table = torch.tensor(sources[source], dtype=torch.int64)
            src.append(slots_of(torch.arange(a, a + n), table, block_size))
            dst.append(slots_of(torch.arange(d, d + n), dst_table, block_size))
            deltas.append(torch.full((n,), d - a, dtype=torch.int64))
        return torch.cat(src).to(device), torch.cat(dst).to(device), torch.cat(deltas)
