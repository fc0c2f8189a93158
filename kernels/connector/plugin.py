"""vLLM KV connector that reuses K/V after clearing instead of recomputing it: a thin adapter.

Loaded by vLLM through its public connector API (``params.transfer_config`` is its config)::

    --kv-transfer-config '{"kv_connector": "AgentKVConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "agentkv.kernels.connector.plugin",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"hold_fraction": 0.25, "hold_ttl_s": 300,
                                                         "offload_bytes": 4294967296, "retain": true}}'

vLLM makes one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER, one per tensor-parallel rank); they share nothing but the per-step metadata. The
scheduler side (``scheduler.ReuseScheduler``, ``held_blocks.HeldBlocks``) holds each
session's last prompt blocks in vLLM's block pool and plans which of them supply a new prompt after
an edit, and reads back what vLLM's prefix cache no longer has of it for a turn with no edit
(retention); the worker side (``worker.KVMover``) moves those tokens between blocks of vLLM's own KV
tensors with ``move_tokens`` (keys re-rotated by the position delta). Whatever cannot be supplied
is computed by vLLM: claims are made only for K/V that is held, and a load that fails on a worker
is reported as failed blocks, which vLLM recomputes (``kv_load_failure_policy: recompute``).
Held blocks vLLM takes back are copied to a host tier (``host_tier.HostTier`` plans it,
``worker.HostStore`` holds it: ``offload_bytes`` per worker) and read from there by the next turn.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .host_tier import tier_blocks
from .params import DEFAULTS
from .scheduler import ReuseScheduler
from .stats import AgentKVPromMetrics, AgentKVStats
from .worker import KVMover, LoadSpec, check_support

FAULT_HANG_ENV = "AGENTKV_FAULT_HANG_FILE"   # tests: while this file exists, a step blocks (a hung engine core)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log: logging.Logger
try:  # vLLM's logger, so the connector's lines appear in the engine log
    from vllm.logger import init_logger

    log = init_logger("vllm.agentkv_connector")
except ImportError:  # pragma: no cover
    log = logging.getLogger("vllm.agentkv_connector")


@dataclass
class AgentKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    spills: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block), run first
    host_blocks: int = 0                                          # the host tier's size in blocks


@dataclass
class AgentKVGeometry(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler side at start-up, after registering its KV tensors:
    why it cannot move tokens in them (``worker.geometry_problem``), or None."""

    problem: str | None = None


class AgentKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = {**DEFAULTS, **(self._kv_transfer_config.kv_connector_extra_config or {})}
        rope, unsupported = check_support(vllm_config)
        if unsupported:
            log.warning("agentkv connector: shifting disabled (%s); every edit recomputes", unsupported)
        self.scheduler: ReuseScheduler | None = None
        self.mover: KVMover | None = None
        holds = unsupported is None and float(extra["hold_fraction"]) > 0   # else nothing is held to spill
        host_blocks, no_tier = tier_blocks(kv_cache_config, int(extra["offload_bytes"]) if holds else 0)
        if no_tier:
            log.warning("agentkv connector: no host tier (%s): held blocks vLLM takes back are lost", no_tier)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ReuseScheduler(vllm_config.cache_config.block_size, unsupported,
                                            float(extra["hold_fraction"]), float(extra["hold_ttl_s"]), host_blocks,
                                            retain=bool(extra["retain"]))
        else:
            self.mover = KVMover(rope, vllm_config.cache_config.block_size, host_blocks)
        self._failed_blocks: set[int] = set()
        self._hang_file = os.environ.get(FAULT_HANG_ENV) if role == KVConnectorRole.SCHEDULER else None

    @property
    def _sched(self) -> ReuseScheduler:
        """The scheduler side's state (vLLM calls the scheduler-side methods on that role only)."""
        assert self.scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self.scheduler

    @property
    def _mover(self) -> KVMover:
        """The worker side's state (vLLM calls the worker-side methods on that role only)."""
        assert self.mover is not None, "a worker-side call on a scheduler-side connector"
        return self.mover

    @property
    def requires_kv_delivery(self) -> bool:
        """Best effort: a load that does not happen is recomputed, nothing is handed off."""
        return False

    # ---- scheduler side: called by vLLM's scheduler, one thread, in the engine-core process ----
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Once, after the KV cache manager exists: the pool whose blocks we hold (touch/unpin)."""
        self._sched.bind(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Before admitting ``request`` (maybe several times while it waits): how many tokens after
        its block-aligned local prefix hit this connector supplies. Synchronous loads only. Its
        one side effect: held blocks are given back when the pool cannot fit the request."""
        return self._sched.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        """After vLLM allocated the request's blocks: the claim stands for ``num_external_tokens``."""
        self._sched.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """End of each schedule(): this step's loads (block ids of held sources and destinations).
        Counts the tokens the step was given (prefill chunks and decodes): the stall watchdog's
        evidence that the engine steps, chunk by chunk."""
        self._sched.stats.add("scheduled_tokens", scheduler_output.total_num_scheduled_tokens)
        while self._hang_file is not None and os.path.exists(self._hang_file):   # a hung engine core (tests)
            time.sleep(0.2)
        # the spills first: an entry this step's loads read and then give back may have been spilled
        # in this very step (its copies run before the loads on the worker)
        spills = self._sched.take_spills()
        loads = self._sched.build_loads(scheduler_output)
        if spills:   # copied before this step's forward pass writes those blocks (as HiSparse does for its loads)
            scheduler_output.has_sync_kv_loads = True
        host = self._sched.host
        return AgentKVMetadata(loads, spills, host.capacity if host is not None else 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """After each step: blocks the workers failed to load mark their requests' outcome."""
        if connector_output.invalid_block_ids:
            self._sched.load_errors(connector_output.invalid_block_ids)

    def has_pending_block_frees(self) -> bool:
        """vLLM cannot allocate for a running request: True if held blocks were given back just now
        (the scheduler retries next step instead of preempting)."""
        return self._sched.pressure()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Once per request, before vLLM frees its blocks: hold them for the session (our own
        reference, so vLLM frees them now as usual) and report an edit's outcome."""
        return False, self._sched.finished(request, block_ids)

    def set_xfer_handshake_metadata_pp_aware(self,
                                             metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Once at start-up, every worker's (every pipeline and tensor-parallel rank's) geometry:
        one that cannot move tokens turns reuse off for all (``geometry``), with a log line."""
        problems = sorted((rank, m.problem) for rank, m in metadata.items()
                          if isinstance(m, AgentKVGeometry) and m.problem)
        if problems and self.scheduler is not None:
            (pp, tp), problem = problems[0]
            log.warning("agentkv connector: reuse disabled, worker pp %d tp %d: %s; every edit recomputes",
                        pp, tp, problem)
            self.scheduler.refuse(problem)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def get_kv_connector_stats(self) -> AgentKVStats | None:
        """After each step: outcomes and the host tier's counts since the last call (scheduler side),
        or the restores measured since then (worker side; vLLM adds them to the scheduler's)."""
        if self.scheduler is not None:
            return self.scheduler.take_stats()
        restored = self._mover.restored.take()
        if not restored["restore_bytes"]:
            return None
        stats = AgentKVStats()
        for name, value in restored.items():
            stats.add(name, value)
        return stats

    def reset_cache(self) -> bool:
        """vLLM's prefix-cache reset: forget every held entry."""
        if self.scheduler is not None:
            self.scheduler.reset()
        return True

    # ---- worker side: called by the model runner of each worker, around every forward pass ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Once, with this worker's KV tensors (its shard of the heads): kept as views, checked."""
        self._mover.register(kv_caches)

    def get_handshake_metadata(self) -> AgentKVGeometry | None:
        """After ``register_kv_caches``: the worker's geometry verdict, for the scheduler side."""
        return AgentKVGeometry(self.mover.problem) if self.mover is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Before the forward pass of a step with loads: every claimed token is in place when it
        returns. Failed loads are remembered for ``get_block_ids_with_load_errors``."""
        meta = self._get_connector_metadata()
        if isinstance(meta, AgentKVMetadata) and meta.spills:     # before the loads write any block
            self._mover.spill(meta.spills, meta.host_blocks)
        if isinstance(meta, AgentKVMetadata) and meta.loads:
            self._failed_blocks |= self._mover.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return   # nothing is saved: the blocks stay where vLLM wrote them

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        """After each step: blocks whose load failed in it (then forgotten)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- vLLM's stats path (API server process) ----------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AgentKVStats:
        return AgentKVStats(data=data) if data else AgentKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AgentKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
