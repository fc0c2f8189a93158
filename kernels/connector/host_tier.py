"""Scheduler side of the host tier: held prompts whose blocks vLLM took back, kept in host memory.

A held entry whose block is handed out (``held_blocks.HeldBlocks.on_lost``) is *spilled*: it gets
host blocks here, and a copy of its device blocks into them is queued for the current step
(``take_spills``). The worker runs a step's spills before its loads and before its forward pass,
and the blocks were handed out in that same step, so what is copied is still what the entry held.
The session's next turn reads the entry from here (the worker's loads take a host source) exactly
as it would from the pool: same key, same identity check, same kernel.

Bounds: ``capacity`` host blocks (``--kv-offload-gib`` over the bytes of one block on one worker).
A spill that does not fit drops entries in retention order (``retention_order``): the session
whose pause began longest ago first (its last turn finished earliest: an agent whose tools are
still running comes back sooner than one its user left), never one a planned load reads
(``protect``); an entry larger than the tier, or with nothing left to drop, is dropped itself. An
entry goes when read (the session holds its new prompt) or superseded, like a held one. Everything
lives in the engine's processes: an engine restart starts empty, and the next turn recomputes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .held_blocks import PRIME, PROMPT, HeldEntry, retention_order

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.agentkv_connector")   # in the engine process, under vLLM's log handlers
COUNTS = ("spilled_blocks", "restored_blocks", "dropped_blocks", "restores")


def tier_blocks(kv_cache_config: KVCacheConfig | None, offload_bytes: int) -> tuple[int, str | None]:
    """The host tier's size in blocks on one worker (both sides compute it from the same config),
    and why there is none where ``offload_bytes`` asks for one. Off where a block handed out can be
    written before the step's spill runs: vLLM zeroes new blocks (``needs_kv_cache_zeroing``), or
    copies into them across several KV cache groups, before the connector's loads."""
    if offload_bytes <= 0:
        return 0, None
    if kv_cache_config is None or not kv_cache_config.num_blocks:
        return 0, "the KV cache config gives no block size in bytes"
    if len(kv_cache_config.kv_cache_groups) != 1:
        return 0, f"{len(kv_cache_config.kv_cache_groups)} KV cache groups"
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        return 0, "vLLM zeroes new KV blocks before the connector's loads"
    per_block = sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks
    return (offload_bytes // per_block, None) if per_block else (0, "KV blocks of 0 bytes")


@dataclass
class HostTier:
    """Spilled entries by (session, kind)."""

    capacity: int
    entries: OrderedDict[tuple[str, str], HeldEntry] = field(default_factory=OrderedDict)
    spills: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block), this step
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))   # since the last report
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def spill(self, entry: HeldEntry, protect: frozenset[int] = frozenset()) -> bool:
        """Give ``entry`` (just lost from the pool, its blocks intact until this step's forward
        pass) host blocks and queue the copy. False when it cannot be kept (counted as dropped)."""
        self.drop(entry.session, entry.kind)
        n = len(entry.blocks)
        others = retention_order(e for e in self.entries.values() if id(e) not in protect)
        if 0 < n <= len(self._free) + sum(len(e.blocks) for e in others):   # else nothing is dropped for it
            for old in others:
                if len(self._free) >= n:
                    break
                self._drop(old, "room")
        if n == 0 or len(self._free) < n:
            self.counts["dropped_blocks"] += n
            log.debug("agentkv connector: %s/%s (%d blocks) not spilled: the host tier has %d free of %d",
                      entry.session[:8], entry.kind, n, len(self._free), self.capacity)
            return False
        entry.host_blocks = [self._free.pop() for _ in range(n)]
        self.spills += zip(entry.block_ids, entry.host_blocks, strict=True)
        self.entries[(entry.session, entry.kind)] = entry
        self.counts["spilled_blocks"] += n
        return True

    def get(self, session: str, kind: str) -> HeldEntry | None:
        return self.entries.get((session, kind))

    def drop(self, session: str, kind: str | None = None) -> None:
        """Forget the session's entries (of ``kind``, or all): read, or superseded."""
        for k in ([kind] if kind else [PROMPT, PRIME]):
            e = self.entries.get((session, k))
            if e is not None:
                self._drop(e, None)

    def take_spills(self) -> list[tuple[int, int]]:
        """The copies queued since the last step's metadata, for this one."""
        spills, self.spills = self.spills, []
        return spills

    def take_counts(self) -> dict[str, int]:
        """Blocks spilled, restored (read by a load) and dropped since the last call."""
        counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return counts

    def clear(self) -> None:
        for e in list(self.entries.values()):
            self._drop(e, None)
        self.spills.clear()

    def _drop(self, e: HeldEntry, why: str | None) -> None:
        del self.entries[(e.session, e.kind)]
        blocks, e.host_blocks = e.host_blocks or [], None
        self._free.extend(reversed(blocks))
        if self.spills:   # its copies queued this step would land on blocks another entry may get now
            gone = set(blocks)
            self.spills = [(d, h) for d, h in self.spills if h not in gone]
        if why is not None:
            self.counts["dropped_blocks"] += len(blocks)
            log.debug("agentkv connector: %s/%s dropped from the host tier (%s)", e.session[:8], e.kind, why)
