"""Scheduler side of the connector: what to hold, what to claim, and what came of it.

The front's instructions arrive per request as ``params.Params`` (see ``params`` for what each
field asks); the outcome of an edit (tokens reused, or why it fell back) goes back with the
finished request as a ``params.Outcome`` and into the counters of ``stats``.

Two kinds of claim: an edit's (``spans``: kept tokens move to new positions, see ``reuse_plan``),
and a turn's with no edit (*retention*): the tokens its prompt shares with the session's held
prompt from the start, past vLLM's own prefix hit, read back at their own positions from the
pool or the host tier, so a session whose blocks vLLM handed out during its pause computes only
what is new. An exact request reads exact entries only (``HeldEntry.exact``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from agentkv.kernels.plan import Span

from .held_blocks import PRIME, PROMPT, HeldBlocks, HeldEntry
from .host_tier import HostTier
from .params import Outcome, Params, Primed
from .reuse_plan import Run, clip, cover
from .stats import AgentKVStats
from .worker import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.agentkv_connector")   # in the engine process, under vLLM's log handlers


def params_of(kv_transfer_params: dict | None) -> Params | None:
    """The front's instructions for a request, or None (malformed ones are ignored with a log line:
    a bad hint must never fail the request)."""
    try:
        return Params.from_wire(kv_transfer_params)
    except ValueError as exc:
        log.warning("agentkv connector: ignoring %s", exc)
        return None


# fallbacks where the session's held prompt is there to read the shared prefix from
PREFIX_FALLBACKS = frozenset({"held_mismatch", "prompt_changed", "too_short"})


def _spans(p: Params) -> tuple[Span, ...]:
    return tuple(Span(*s) for s in p.spans)


def _source(e: HeldEntry | None) -> list[int]:
    """The block ids a load reads an entry from: its pool blocks, or its host blocks once the pool
    took those back (none if the tier dropped it since: the load fails and vLLM recomputes)."""
    if e is None:
        return []
    return e.block_ids if e.valid else list(e.host_blocks or [])


def _blocks_read(runs: list[Run], source: int, block_size: int) -> int:
    return len({b for r in runs if r.source == source
                for b in range(r.src_start // block_size, (r.src_start + r.length - 1) // block_size + 1)})


@dataclass
class Claim:
    request_id: str
    session: str
    entries: list[HeldEntry | None]   # by reuse_plan source index
    runs: list[Run]
    start: int
    end: int
    edit: bool = True                 # an edit's claim (its outcome is reported), else retention's


@dataclass
class ReuseScheduler:
    block_size: int
    unsupported: str | None          # why nothing can be shifted in this engine, or None
    hold_fraction: float
    ttl_s: float
    host_blocks: int = 0             # the host tier's capacity in blocks (0: no tier)
    retain: bool = True              # turns with no edit read back their session's held prompt
    held: HeldBlocks | None = None
    host: HostTier | None = None
    claims: dict[str, Claim] = field(default_factory=dict)
    loading: dict[str, LoadSpec] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    retained: dict[str, int] = field(default_factory=dict)    # tokens retention loads for a request
    stats: AgentKVStats = field(default_factory=AgentKVStats)
    geometry: str | None = None      # why a worker cannot move in its KV tensors, or None
    _reported_held: int = -1
    _reported_host: int = -1

    def bind(self, pool: BlockPool) -> None:
        budget = int(self.hold_fraction * pool.num_gpu_blocks) if self.unsupported is None else 0
        self.held = HeldBlocks(pool, self.block_size, budget, self.ttl_s, on_lost=self._spill,
                               on_reset=self._forget_host)
        if budget > 0 and self.host_blocks > 0:
            self.host = HostTier(self.host_blocks)
            log.info("agentkv connector: a host tier of %d blocks keeps held prompts the pool takes back",
                     self.host_blocks)
        if self.unsupported is None and budget <= 0:
            log.warning("agentkv connector: the held-block budget is zero (hold_fraction %s of %d blocks): "
                        "nothing is held, every edit recomputes", self.hold_fraction, pool.num_gpu_blocks)
        elif self.unsupported is None:
            log.info("agentkv connector: holding up to %d of %d KV blocks for sessions' next turns, "
                     "for at most %.0f s each", budget, pool.num_gpu_blocks, self.ttl_s)

    def _spill(self, entry: HeldEntry) -> None:
        """A held entry lost its blocks to another request this step: copy it to the host tier."""
        if self.host is not None:
            self.host.spill(entry, protect=self._claimed())

    def _forget_host(self) -> None:
        if self.host is not None:
            self.host.clear()

    def _claimed(self, but: str | None = None) -> frozenset[int]:
        """Entries that planned loads read (of requests other than ``but``)."""
        return frozenset(id(e) for c in self.claims.values() if c.request_id != but for e in c.entries
                         if e is not None)

    def _entry(self, session: str, kind: str, exact: bool = False) -> HeldEntry | None:
        """The session's entry of ``kind`` in the pool, else in the host tier, else None; with
        ``exact``, only an entry an exact request held (none with moved K/V)."""
        entry = self.bound.get(session, kind)
        if entry is None and self.host is not None:
            entry = self.host.get(session, kind)
        return None if entry is None or (exact and not entry.exact) else entry

    def _drop(self, session: str, kind: str | None = None) -> None:
        self.bound.drop(session, kind)
        if self.host is not None:
            self.host.drop(session, kind)

    @property
    def bound(self) -> HeldBlocks:
        """The held blocks, once `bind` has run (admission returns before planning until then)."""
        assert self.held is not None, "the connector's scheduler is not bound to vLLM's block pool yet"
        return self.held

    # -- admission -------------------------------------------------------------------------
    def matched(self, request: Request, num_computed: int) -> int:
        """Tokens after ``num_computed`` (vLLM's block-aligned local hit) this connector supplies."""
        p = params_of(request.kv_transfer_params)
        if self.held is None:
            return 0
        need = -(-request.num_tokens // self.block_size) + 1
        self.held.make_room(need, keep=p.session if p else None, protect=self._claimed(but=request.request_id))
        if p is None or p.prime or request.num_preemptions or (not p.spans and (p.keep or not self.retain)):
            return 0
        self.claims.pop(request.request_id, None)
        if p.spans:
            claim, why = self._plan(request, p, num_computed, need)
            if claim is None and why in PREFIX_FALLBACKS:
                claim = self._prefix(request, p, num_computed, need)
            self.outcomes[request.request_id] = Outcome(claim.end - claim.start if claim else 0, why)
        else:
            claim = self._retained(request, p, num_computed, need)
        if claim is None:
            return 0
        self.held.pin([e for e in claim.entries if e is not None and e.valid])
        self.claims[request.request_id] = claim
        return claim.end - claim.start

    def refuse(self, geometry: str) -> None:
        """A worker's KV tensors cannot be moved in (``worker.geometry_problem``): every edit falls
        back (``geometry``), and nothing is held."""
        self.geometry = geometry
        if self.held is not None:
            self.held.forget_all()

    def _plan(self, request: Request, p: Params, start: int, need: int) -> tuple[Claim | None, str | None]:
        if self.unsupported is not None:
            return None, "unsupported"
        if self.geometry is not None:
            return None, "geometry"
        if self.bound.budget <= 0:
            return None, "no_budget"
        prompt = self._entry(p.session, PROMPT, p.exact)
        if prompt is None:
            return None, self.bound.missing_reason(p.session)
        if p.held is None or p.held != prompt.identity:   # before anything is read from it
            return None, "held_mismatch"
        prime = self._entry(p.session, PRIME, p.exact) if any(n for _, _, n in p.spans) else None
        return self._claim(request, p, [prompt, prime], _spans(p), start, need)

    def _prefix(self, request: Request, p: Params, start: int, need: int) -> Claim | None:
        """An edit that fell back still reads what recompute would have read: the tokens its prompt
        shares with the held prompt from the start, at the same positions (no rotation; the K/V of
        a position depend on the tokens up to it only), which vLLM's cache under the branch's
        approximate salt may not hold yet (its first moved edit)."""
        prompt = self._entry(p.session, PROMPT, p.exact)
        return None if prompt is None else self._claim(request, p, [prompt, None], (), start, need)[0]

    def _retained(self, request: Request, p: Params, start: int, need: int) -> Claim | None:
        """A turn with no edit: what its prompt shares with the session's held prompt from the
        start, past vLLM's own hit (blocks vLLM handed out during the session's pause, read back
        from the host tier; or cached under another salt), at the same positions."""
        if self.unsupported is not None or self.geometry is not None or self.bound.budget <= 0:
            return None
        prompt = self._entry(p.session, PROMPT, p.exact)
        claim = None if prompt is None else self._claim(request, p, [prompt, None], (), start, need)[0]
        if claim is not None:
            claim.edit = False
        return claim

    def _claim(self, request: Request, p: Params, entries: list[HeldEntry | None], spans: tuple[Span, ...],
               start: int, need: int) -> tuple[Claim | None, str | None]:
        """What ``entries`` (by source index) supply of the request from ``start`` under ``spans``:
        the claim, or why there is none."""
        repin = sum(len(e.blocks) for e in entries if e is not None and e.valid and not e.pinned)
        if repin and self.bound.pool.get_num_free_blocks() - repin < need:
            return None, "evicted"                   # memory pressure: its blocks are needed
        ids = request.prompt_token_ids or []
        limit = len(ids) - 1 if p.limit is None else min(p.limit, len(ids) - 1)
        cov = cover(ids, [None if e is None else e.token_ids for e in entries], spans, start, limit)
        end = cov.end // self.block_size * self.block_size
        if end <= start:
            if cov.stop == "missing":
                return None, self.bound.missing_reason(p.session)
            return None, "prompt_changed" if cov.stop in ("mismatch", "prefix") and cov.end - start < self.block_size \
                else "too_short"
        runs = clip(cov.runs, end)
        return Claim(request.request_id, p.session,
                     [e if any(r.source == i for r in runs) else None for i, e in enumerate(entries)],
                     runs, start, end), None

    def allocated(self, request: Request, num_external: int) -> None:
        """vLLM allocated blocks for ``num_external`` claimed tokens (it may take fewer, or none)."""
        claim = self.claims.get(request.request_id)
        if claim is None:
            return
        if num_external <= 0:
            del self.claims[request.request_id]
            if claim.edit:
                self.outcomes[request.request_id] = Outcome(0, None)    # its own prefix hit covered it
        elif claim.start + num_external < claim.end:
            claim.end = claim.start + num_external
            claim.runs = clip(claim.runs, claim.end)
            if claim.edit:
                self.outcomes[request.request_id] = Outcome(num_external, None)

    # -- each step -------------------------------------------------------------------------
    def build_loads(self, out: SchedulerOutput) -> list[LoadSpec]:
        """Loads for the requests scheduled for the first time this step; then give back what
        their sessions held before (the loads' block ids are taken, the worker runs this step's
        loads before any later step can reuse those blocks)."""
        loads: list[LoadSpec] = []
        if self.held is None:
            return loads
        for new in out.scheduled_new_reqs:
            claim = self.claims.pop(new.req_id, None)
            if claim is not None:
                spec = LoadSpec(new.req_id, list(new.block_ids[0]), [_source(e) for e in claim.entries],
                                [(r.source, r.src_start, r.dst_start, r.length) for r in claim.runs],
                                [e is not None and not e.valid for e in claim.entries])
                loads.append(spec)
                self.loading[new.req_id] = spec
                if not claim.edit:
                    self.retained[new.req_id] = claim.end - claim.start
                restored = [i for i, e in enumerate(claim.entries) if e is not None and not e.valid and e.host_blocks]
                if self.host is not None and restored:
                    self.host.counts["restores"] += 1
                    self.host.counts["restored_blocks"] += sum(_blocks_read(claim.runs, i, self.block_size)
                                                               for i in restored)
            sp = new.sampling_params
            p = params_of((sp.extra_args or {}).get("kv_transfer_params") if sp is not None else None)
            if p is not None and not p.prime and not p.keep:
                self._drop(p.session)
        self.held.expire()
        if loads:
            log.info("agentkv connector: step loads %s",
                     [(s.req_id[-8:], sum(r[3] for r in s.runs), len(s.runs)) for s in loads])
        return loads

    def load_errors(self, invalid_block_ids: set[int]) -> None:
        """The workers could not write these blocks; vLLM recomputes the requests that claimed them."""
        for req_id, spec in self.loading.items():
            if spec.dst_block_ids(self.block_size) & invalid_block_ids:
                if req_id in self.retained:
                    self.retained[req_id] = 0
                    self.stats.add("retain_failed", 1)
                else:
                    self.outcomes[req_id] = Outcome(0, "load_failed")

    def pressure(self) -> bool:
        """vLLM cannot allocate for a running request: give held blocks back instead of preempting."""
        return self.held is not None and self.held.release_all("pressure")

    # -- end of a request ------------------------------------------------------------------
    def finished(self, request: Request, block_ids: list[int]) -> dict | None:
        """Hold the prompt blocks of a request that finished normally; report an edit's outcome."""
        from vllm.v1.request import RequestStatus

        self.claims.pop(request.request_id, None)
        self.loading.pop(request.request_id, None)
        retained = self.retained.pop(request.request_id, 0)
        if retained:
            self.stats.add("retained_tokens", retained)
            self.stats.add("retained_turns", 1)
        p = params_of(request.kv_transfer_params)
        ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                                RequestStatus.FINISHED_REPETITION)
        prompt = request.prompt_token_ids or []
        if (p is not None and not p.keep and ok and self.held is not None and self.unsupported is None
                and self.geometry is None and request.num_computed_tokens >= len(prompt)):
            ids = cast("Sequence[int]", np.asarray(prompt, dtype=np.int64))   # an array reads as a sequence here
            kind = PRIME if p.prime else PROMPT
            if self.host is not None:
                self.host.drop(p.session, kind)
            self.held.hold(p.session, kind, ids, block_ids, exact=p.exact)
        outcome = self.outcomes.pop(request.request_id, None)
        if p is not None and p.prime and self.held is not None:   # what the front's blend plans need
            entry = self._entry(p.session, PROMPT)
            usable = entry if entry is not None and (p.held is None or p.held == entry.identity) else None
            return Primed(self.block_size, len(usable.token_ids) if usable is not None else 0).to_wire()
        if outcome is None:
            return None
        if outcome.fallback:
            log.info("agentkv connector: %s recomputes what it could have reused: %s", request.request_id,
                     outcome.fallback)
        self.stats.count(outcome.fallback, outcome.reused_tokens)
        return outcome.to_wire()

    def take_spills(self) -> list[tuple[int, int]]:
        """This step's copies of lost held blocks to the host tier (device block, host block)."""
        return self.host.take_spills() if self.host is not None else []

    def take_stats(self) -> AgentKVStats | None:
        held = self.held.held_blocks if self.held is not None else 0
        if held != self._reported_held:
            self.stats.data["held_blocks"] = self._reported_held = held
        if self.host is not None:
            for name, n in self.host.take_counts().items():
                self.stats.add(name, n)
            if self.host.used != self._reported_host:
                self.stats.data["host_blocks"] = self._reported_host = self.host.used
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, AgentKVStats()
        return stats

    def reset(self) -> None:
        if self.held is not None:
            self.held.forget_all()
        if self.host is not None:
            self.host.clear()
        self.claims.clear()
        self.retained.clear()
