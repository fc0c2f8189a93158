"""Scheduler side of the connector: each session's last prompt blocks, kept in vLLM's own block pool.

When a request of a session finishes, its prompt blocks are *held*: the connector takes one
reference on each (``BlockPool.touch``), so vLLM neither frees nor reuses them, and remembers the
prompt's token ids. A priming request's blocks are held beside them. The next request of the
session reads them (the worker moves tokens out of them) and then they are given back.

Bounds: a budget of held block references (a share of the pool) and a time-to-live. Past either,
or when vLLM runs short of blocks, held blocks are *released*: the reference goes back with
``BlockPool.unpin_blocks``, which counts the blocks as free again but tells us when one is handed
out; until then a released entry can still be read (its blocks are still what they were). An entry
whose block was handed out is gone from the pool ("evicted"); ``on_lost`` hears of it at that moment,
inside the scheduler step that handed the block out, so the blocks can still be copied to the host
tier (``host_tier``) before that step's forward pass writes them. A prompt larger than the whole
budget is held released from the start. Everything lives in the scheduler process, so an engine
restart starts empty. Not thread-safe: vLLM calls the scheduler side from one thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .params import prompt_hash

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

PROMPT, PRIME = "prompt", "prime"
MAX_ENTRIES = 16384           # entries kept (held or released-but-readable)
MAX_FORGOTTEN = 4096          # sessions whose evicted entries we still remember (for the reason)

log = logging.getLogger("vllm.agentkv_connector")   # in the engine process, under vLLM's log handlers


@dataclass(eq=False)
class HeldEntry:
    session: str
    kind: str                      # PROMPT or PRIME
    token_ids: Sequence[int]        # the prompt's ids (a numpy array from the connector)
    blocks: list[KVCacheBlock]
    held_at: float
    pinned: bool = True            # we hold a reference on every block
    valid: bool = True             # no block was handed out since
    host_blocks: list[int] | None = None   # where the host tier keeps a copy (``host_tier``), or None
    exact: bool = False            # held by an exact request: every K/V computed, none moved (``params``)
    _digest: str | None = None

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def identity(self) -> tuple[int, str]:
        """(tokens, ``params.prompt_hash``): what the front names the prompt an edit is on by."""
        if self._digest is None:
            self._digest = prompt_hash(self.token_ids)
        return len(self.token_ids), self._digest


def retention_order(entries: Iterable[HeldEntry]) -> list[HeldEntry]:
    """Which entries go first when room is needed, in the pool (released) or in the host tier
    (dropped): the longest paused session first (held earliest: its turn finished before the
    others', and an agent whose tools are still running comes back sooner than one its user left),
    and of two held at once the larger (it makes the room with fewer sessions losing their K/V)."""
    return sorted(entries, key=lambda e: (e.held_at, -len(e.blocks)))


@dataclass
class HeldBlocks:
    """Entries by (session, kind), least recently held first. ``budget`` counts block references."""

    pool: BlockPool
    block_size: int
    budget: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    on_lost: Callable[[HeldEntry], None] | None = None   # an entry's block was just handed out
    on_reset: Callable[[], None] | None = None           # vLLM reset its prefix cache
    entries: OrderedDict[tuple[str, str], HeldEntry] = field(default_factory=OrderedDict)
    evicted: OrderedDict[str, str] = field(default_factory=OrderedDict)   # sessions whose entry went
    _watched: dict[int, set[HeldEntry]] = field(default_factory=dict)     # block id -> released entries
    held_blocks: int = 0           # block references held now (a block in two entries counts twice)

    def hold(self, session: str, kind: str, token_ids: Sequence[int], block_ids: list[int],
             exact: bool = False) -> str | None:
        """Hold the blocks of ``token_ids`` (a finished request's; the caller still owns them)
        for ``session``, replacing its previous entry of this kind; ``exact``: the request read and
        computed exact K/V only. Returns why not, or None."""
        n = -(-len(token_ids) // self.block_size)
        blocks = [self.pool.blocks[i] for i in block_ids[:n]]
        self.drop(session, kind)
        if self.budget <= 0:
            return "no_budget"
        if n == 0 or len(blocks) < n or any(b.is_null for b in blocks):
            return "not_held"
        over = n > self.budget
        while not over and self.held_blocks + n > self.budget:
            self._release(retention_order(e for e in self.entries.values() if e.pinned)[0], "budget")
        self.pool.touch(blocks)
        self.held_blocks += n
        entry = self.entries[(session, kind)] = HeldEntry(session, kind, token_ids, blocks, self.clock(), exact=exact)
        if over:   # readable until handed out, like any released entry (and then spilled, if a tier takes it)
            log.info("agentkv connector: %d blocks exceed the held-block budget %d; released at once", n, self.budget)
            self._release(entry, "budget")
        if kind == PROMPT:
            self.evicted.pop(session, None)
        while len(self.entries) > MAX_ENTRIES:
            e = next(iter(self.entries.values()))
            self.drop(e.session, e.kind)
        return None

    def get(self, session: str, kind: str) -> HeldEntry | None:
        entry = self.entries.get((session, kind))
        return entry if entry is not None and entry.valid else None

    def missing_reason(self, session: str) -> str:
        """Why ``session`` has no usable prompt entry: it was evicted, or never held."""
        return "evicted" if session in self.evicted else "not_held"

    def pin(self, entries: list[HeldEntry]) -> None:
        """Take references again on released (still valid) entries about to be read."""
        for e in entries:
            if not e.pinned and e.valid:
                self.pool.touch(e.blocks)
                self.held_blocks += len(e.blocks)
                e.pinned = True
                self._unwatch(e)

    def drop(self, session: str, kind: str | None = None) -> None:
        """Forget the session's entries (of ``kind``, or all): they were read, or are superseded.
        Held references go back to the pool as plain frees (no one reads them any more)."""
        for k in ([kind] if kind else [PROMPT, PRIME]):
            e = self.entries.pop((session, k), None)
            if e is None:
                continue
            if e.pinned:
                self.pool.free_blocks(reversed(e.blocks))
                self.held_blocks -= len(e.blocks)
            self._unwatch(e)

    def make_room(self, need_blocks: int, keep: str | None = None, protect: frozenset[int] = frozenset()) -> None:
        """Release held entries in ``retention_order`` (``keep``'s session last), until the
        pool has ``need_blocks`` free blocks: a request about to be admitted needs them. Entries
        whose ``id`` is in ``protect`` (sources of loads planned this step) stay."""
        order = sorted(retention_order(e for e in self.entries.values() if e.pinned and id(e) not in protect),
                       key=lambda e: e.session == keep)
        for e in order:
            if self.pool.get_num_free_blocks() >= need_blocks:
                return
            self._release(e, "pressure")

    def release_all(self, why: str) -> bool:
        """Release every held entry (vLLM is out of blocks for a running request). True if any was."""
        pinned = [e for e in self.entries.values() if e.pinned]
        for e in pinned:
            self._release(e, why)
        return bool(pinned)

    def expire(self) -> None:
        now = self.clock()
        for e in [e for e in self.entries.values() if e.pinned and now - e.held_at >= self.ttl_s]:
            self._release(e, "ttl")

    def forget_all(self) -> None:
        for session, kind in list(self.entries):
            self.drop(session, kind)

    def _release(self, e: HeldEntry, why: str) -> None:
        e.pinned = False
        self.held_blocks -= len(e.blocks)
        for b in e.blocks:
            self._watched.setdefault(b.block_id, set()).add(e)
        self.pool.unpin_blocks(e.blocks, self._handed_out)
        log.debug("agentkv connector: released %s/%s (%d blocks, %s)", e.session[:8], e.kind, len(e.blocks), why)

    def _unwatch(self, e: HeldEntry) -> None:
        for b in e.blocks:
            watchers = self._watched.get(b.block_id)
            if watchers is not None:
                watchers.discard(e)
                if not watchers:
                    del self._watched[b.block_id]

    def _handed_out(self, block: KVCacheBlock) -> None:
        """BlockPool callback: a released block was given to another request (or the cache was reset:
        vLLM resets only when every block is free, which no hand-out leaves it; then nothing read so
        far may be read again, not even from the host tier)."""
        resetting = self.pool.get_num_free_blocks() == self.pool.num_gpu_blocks - 1
        if resetting and self.on_reset is not None:
            self.on_reset()
        for e in self._watched.pop(block.block_id, set()):
            e.valid = False
            self._unwatch(e)
            if self.entries.get((e.session, e.kind)) is e:
                del self.entries[(e.session, e.kind)]
            self._mark_evicted(e.session)
            if self.on_lost is not None and not resetting:
                self.on_lost(e)

    def _mark_evicted(self, session: str) -> None:
        self.evicted[session] = "evicted"
        self.evicted.move_to_end(session)
        while len(self.evicted) > MAX_FORGOTTEN:
            self.evicted.popitem(last=False)
