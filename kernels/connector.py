"""vLLM KV connector that reuses cached K/V after clearing instead of recomputing it.

Loaded by vLLM through its public connector API::

    --kv-transfer-config '{"kv_connector": "AgentKVConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "agentkv.kernels.connector"}'

The front drives it per request with ``kv_transfer_params = {"agentkv": {...}}``:

- ``"save": KEY`` -- after this prompt's prefill, copy every layer's K/V of the whole prompt into
  the worker's store under KEY (only when the prompt is prefilled in one step).
- ``"load": {"hash": H, "runs": [[KEY, src_start, src_end, dst_start], ...], "recompute_tail": N}``
  -- this prompt (its token ids hash to H) can take the K/V of stored tokens ``src_start..src_end``
  of KEY at positions from ``dst_start`` on; keys are re-rotated by ``dst_start - src_start`` with
  ``agentkv.kernels.move_tokens``. The connector supplies the contiguous covered range after
  vLLM's own prefix-cache hit, less the last N tokens (which vLLM recomputes: the blend mode).

Scheduler side and worker side run in different processes and share nothing but the metadata.
Anything that does not check out (hash, token ids, a missing store entry, an unsupported RoPE)
falls back to vLLM's recompute: claims are 0, or the blocks are reported as load errors.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from .evict import move_tokens
from .kv_store import KVStore
from .layout import PagedKV
from .rope import RopeParams, UnsupportedShift

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

try:  # vLLM's logger, so the connector's lines appear in the engine log
    from vllm.logger import init_logger

    log = init_logger("vllm.agentkv_connector")
except ImportError:  # pragma: no cover
    log = logging.getLogger("agentkv.connector")


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    runs: list[tuple[str, int, int, int]]     # (key, src_start, src_end, dst_start), clipped to [start, end)
    token_ids: list[int]                      # the prompt's ids at [start, end)
    start: int
    end: int


@dataclass
class SaveSpec:
    req_id: str
    key: str
    block_ids: list[int]
    token_ids: list[int]


@dataclass
class AgentKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def covered_runs(runs: list, start: int, limit: int) -> tuple[list[tuple[str, int, int, int]], int]:
    """The runs clipped to the contiguous range of positions covered from ``start`` (before
    ``limit``), and where that range ends."""
    pos, out = start, []
    for key, a, b, d in sorted((tuple(r) for r in runs), key=lambda r: r[3]):
        if d + (b - a) <= pos:
            continue
        if d > pos or pos >= limit:
            break
        hi = min(d + (b - a), limit)
        out.append((key, a + (pos - d), a + (hi - d), pos))
        pos = hi
    return out, pos


class AgentKVConnector(KVConnectorBase_V1):
    """Thin adapter: scheduler side decides claims, worker side moves tokens with the kernel."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        try:
            self.rope: RopeParams | None = RopeParams.from_hf_config(vllm_config.model_config.hf_config)
        except (UnsupportedShift, AttributeError, KeyError) as exc:
            log.warning("agentkv connector: shifting disabled (%s); every request recomputes", exc)
            self.rope = None
        if str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
            log.warning("agentkv connector: fp8 KV cache (rotating it needs its scales); shifting disabled")
            self.rope = None
        # scheduler side
        self._pending: dict[str, dict] = {}
        # worker side
        self.store = KVStore(int(float(extra.get("store_gib", 2)) * 2**30))
        self.caches: dict[str, PagedKV] = {}
        self._load_errors: set[int] = set()
        self._saving: dict[str, Any] = {}

    # ---- scheduler side -------------------------------------------------------------------
    @staticmethod
    def _params(request: Request) -> dict:
        return ((request.kv_transfer_params or {}).get("agentkv") or {}) if request.kv_transfer_params else {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free apart from remembering the plan: how many tokens after the local
        prefix-cache hit this connector supplies (block-aligned)."""
        load = self._params(request).get("load")
        ids = list(request.prompt_token_ids or [])
        if not load or self.rope is None or load.get("hash") != prompt_hash(ids):
            return 0, False
        limit = len(ids) - 1 - int(load.get("recompute_tail", 0))
        runs, end = covered_runs(load.get("runs", []), num_computed_tokens, limit)
        end = end // self.block_size * self.block_size
        if end <= num_computed_tokens:
            return 0, False
        runs, _ = covered_runs(runs, num_computed_tokens, end)
        self._pending[request.request_id] = {"runs": runs, "start": num_computed_tokens, "end": end}
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        """The claim stands only if vLLM allocated blocks for it; the block ids are read from the
        scheduler output in build_connector_meta."""
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = AgentKVMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.prompt_token_ids or [])
            plan = self._pending.pop(new.req_id, None)
            if plan is not None:
                meta.loads.append(LoadSpec(new.req_id, list(new.block_ids[0]), plan["runs"],
                                           ids[plan["start"]:plan["end"]], plan["start"], plan["end"]))
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None
            key = ((params or {}).get("agentkv") or {}).get("save")
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if key and new.num_computed_tokens + scheduled >= len(ids):
                meta.saves.append(SaveSpec(new.req_id, key, list(new.block_ids[0]), ids))
            elif key:
                log.info("agentkv connector: %s prefilled in chunks, not saved", new.req_id)
        if meta.loads or meta.saves:
            log.info("agentkv connector: step loads %s, saves %s",
                     [(x.req_id[-8:], x.start, x.end, len(x.runs)) for x in meta.loads],
                     [(x.req_id[-8:], len(x.token_ids)) for x in meta.saves])
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()), None)
        if first is not None and first.dim() == 4 and self._cpu_isa(first) != "vec":
            log.warning("agentkv connector: CPU attention ISA %s has a packed KV layout this connector "
                        "does not read; shifting disabled, every request recomputes", self._cpu_isa(first))
            self.rope = None
        self.caches = {name: PagedKV.from_vllm(t) for name, t in kv_caches.items()}
        log.info("agentkv connector: %d KV layers, e.g. %s %s", len(kv_caches),
                 *next(((n, tuple(t.shape)) for n, t in kv_caches.items()), ("-", ())))

    def _cpu_isa(self, cache: torch.Tensor) -> str:
        """The CPU attention kernel family vLLM picked; its KV layout is what from_cpu reads for "vec"."""
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return _get_attn_isa(cache.dtype, self.block_size, cache.shape[-1] // 2,
                                 self._vllm_config.cache_config.cache_dtype)
        except (ImportError, TypeError) as exc:
            return f"unknown ({exc})"

    def _slots(self, block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[positions // block_size] * block_size + positions % block_size

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Synchronous: every claimed token is in place before the forward pass starts."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, AgentKVMetadata) or not meta.loads or self.rope is None:
            return
        t0 = time.perf_counter()
        for spec in meta.loads:
            entries = {k: self.store.get(k) for k, *_ in spec.runs}
            ok = all(e is not None for e in entries.values())
            for key, a, b, d in spec.runs if ok else []:
                src_ids = entries[key].token_ids[a:b]
                if src_ids != spec.token_ids[d - spec.start:d - spec.start + (b - a)]:
                    ok = False
            if not ok:
                log.warning("agentkv connector: %s cannot be loaded; vLLM recomputes it", spec.req_id)
                self._load_errors.update(spec.block_ids[spec.start // self.block_size:
                                                        -(-spec.end // self.block_size)])
                continue
            for name, cache in self.caches.items():
                for key, a, b, d in spec.runs:
                    src = entries[key].layers[name]
                    pos = torch.arange(d, d + (b - a))
                    move_tokens(src, cache, torch.arange(a, b), self._slots(spec.block_ids, pos, cache.block_size),
                                torch.full((b - a,), d - a, dtype=torch.int64), self.rope)
        log.info("agentkv connector: loaded %d tokens in %.4f s", sum(s.end - s.start for s in meta.loads),
                 time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, AgentKVMetadata):
            return
        for spec in meta.saves:
            entry = self._saving.get(spec.key)
            if entry is None:
                entry = self._saving[spec.key] = self.store.begin(spec.key, spec.token_ids)
            cache = PagedKV.from_vllm(kv_layer)
            pos = torch.arange(len(spec.token_ids))
            self.store.save_layer(entry, layer_name, cache, self._slots(spec.block_ids, pos, cache.block_size))

    def wait_for_save(self) -> None:
        self._saving.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
