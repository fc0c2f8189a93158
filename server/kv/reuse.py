"""KV reuse after clearing, the front's part: say which edit happened; the connector does the rest.

Every chat request of a session (in every mode with retention, ``--kv-retention``; else in ``shift``
or ``blend`` mode) names the session to the engine's KV connector, and whether it is exact (its
cache salt is the exact one: it reads only K/V held by exact requests). The connector
(``agentkv.kernels.connector.plugin``) holds the blocks of the session's last prompt in vLLM's pool
(then its host tier) and reads back what vLLM's prefix cache lost of them on the session's next
turn. When clearing edits the prompt (``shift``, ``blend``), the front sends the edit: spans of the previous
prompt and how many replacement (placeholder) tokens each got. The placeholders' K/V are computed
by a short priming request first: the shared prefix plus all placeholders back to back, held by the
connector beside the prompt. The connector, which sees vLLM's own token ids and blocks, decides
what it can move and moves it; the rest is computed by vLLM. Its outcome comes back with a
non-streamed response (``kv_transfer_params``) and is counted in the engine's metrics either way.
``blend`` also recomputes a share of the moved tokens, chosen by a strategy (``kv_blend``), with
passes run here before the request (see ``kv_blend``). What runs for which mode is the mode's
(``server.kv_modes``); ``ReuseJob`` holds the edited request and runs the engine requests it asks for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentkv.compaction import edit_kinds
from agentkv.compaction.edits import PromptEdit
from agentkv.kernels.connector.params import Outcome, Params, Primed
from agentkv.server.config import ServeConfig
from agentkv.server.kv_modes import Recompute, kv_mode
from agentkv.server.metrics import KV_EDITS, KV_FALLBACKS, KV_PRIMED
from agentkv.server.options import KVBlend, KVMode

from . import blend as kv_blend

if TYPE_CHECKING:
    from agentkv.server.engine.client import EngineClient
    from agentkv.server.pipeline.context import Prepared

_KEY = secrets.token_bytes(32)   # session tokens are unguessable by clients
# the deviation probe runs a model layer on the front's CPU: on a thread of its own (never the pool
# other work of the front queues on), over at most this many tokens in all (else blend's tail)
_PROBE = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentkv-probe")
PROBE_MAX_TOKENS = 32_768

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Salts:
    """The request's two possible cache salts (``pipeline.cache_salt``): K/V vLLM computed, and the
    conversation branch's once moved K/V are in its prompt."""

    exact: str
    approximate: str


def session_token(session: str) -> str:
    """What the connector knows a session by: a keyed digest of its storage key (owner/id)."""
    return hmac.new(_KEY, session.encode(), hashlib.sha256).hexdigest()[:32]


def _kv_reports(prepared) -> list[dict]:
    """The ``kv`` entries of the applied edits whose report carries the connector's part (clearing's)."""
    return [e.setdefault("kv", {}) for e in prepared.report["applied_edits"]
            if (kind := edit_kinds.named(e["type"])) is not None and kind.kv_report]


@dataclass
class ReuseJob:
    """One edited request's KV reuse, as its mode (``kv_modes``) plans it: the engine requests a
    mode may run before the edited one are this object's methods."""

    cfg: ServeConfig
    engine: EngineClient
    body: dict                   # the edited request
    prepared: Prepared           # its context step's result
    edits: list[PromptEdit]      # clearing's edits, in prompt order
    params: Params               # the edited request's instructions to the connector
    options: KVBlend | None      # the request's ``kv_blend``
    model_path: str | None       # the served model (the deviation probe loads its first layers)
    salts: Salts

    @functools.cached_property
    def replacement_ids(self) -> list[int]:
        """The placeholders' tokens, back to back (what the priming request computes)."""
        return [t for e in self.edits for t in e.replacement_ids]

    async def prime(self) -> Primed | None:
        """The priming request: the shared prefix plus all placeholders back to back, held by the
        connector beside the prompt; it reads the branch's cache as it was before this request."""
        prepared = self.prepared
        prime = {"model": self.body["model"], "prompt": prepared.old_ids[:self.edits[0].start] + self.replacement_ids,
                 "max_tokens": 1,
                 "kv_transfer_params": Params(self.params.session, prime=True, held=prepared.held).to_wire(),
                 "cache_salt": self.salts.approximate if prepared.moved_before else self.salts.exact}
        status, payload = await self.engine.post_json("/v1/completions", prime)
        if status != 200:   # the connector then finds no priming prompt and says so
            log.warning("session %s: priming request answered %s", prepared.session_id, status)
            return None
        return Primed.from_wire(payload.get("kv_transfer_params"))

    async def blend(self, primed: Primed | None) -> tuple[int | None, dict]:
        """Blend's passes (``kv_blend``), reading moved K/V (the approximate salt): the request's own
        ``limit`` and what they did, for the edit's ``kv`` report."""
        return await _blend(self.cfg, self.engine, self.body, self.params, self.prepared, self.edits,
                            self.replacement_ids, primed, self.options or KVBlend(), self.model_path,
                            self.salts.approximate)


async def attach(cfg: ServeConfig, engine, body: dict, prepared, mode: KVMode | None, blend: KVBlend | None,
                 model_path: str | None, salts: Salts) -> None:
    """Set the engine request's ``cache_salt`` and ``kv_transfer_params``; after clearing, run what
    the mode runs first (``KVReuseMode.primes``, ``refine``). ``mode`` / ``blend``: the request's,
    else the server's; ``model_path``: the served model (the deviation probe loads its first layers).
    Records the edit in the report.

    Salts: a request whose prompt may hold moved K/V (the connector on, a mode that moves K/V, and
    such an edit made in its branch, by it or before it) takes the branch's approximate salt,
    every other request the exact one; the priming request reads the branch's cache as it was
    before this request (exact until its first moved edit), blend's passes read moved K/V."""
    reuse = kv_mode(mode or cfg.kv_reuse)
    body["cache_salt"] = salts.approximate if reuse.moves(cfg) and prepared.moved else salts.exact
    if not cfg.kv_connector:
        if reuse.uses_connector and prepared.edits:
            log.warning("kv_reuse %s asked (session %s), but this server runs without the KV connector "
                        "(--kv-reuse %s --no-kv-retention): recomputing", reuse.name, prepared.session_id,
                        cfg.kv_reuse)
            KV_FALLBACKS.labels("connector_disabled").inc()
            for kv in _kv_reports(prepared):
                kv.update(mode=Recompute.name, requested=reuse.name, fallback="connector_disabled")
        return
    # held for the session's next turn; exact where the salt is (its K/V all computed, none moved)
    params = Params(session_token(prepared.branch), exact=body["cache_salt"] == salts.exact)
    if not reuse.uses_connector:
        if cfg.kv_retention:      # recompute: held and read back, never edited
            body["kv_transfer_params"] = params.to_wire()
        return
    if prepared.edits:
        edits = sorted(prepared.edits, key=lambda e: e.start)
        params = dataclasses.replace(params, spans=tuple((e.start, e.end, len(e.replacement_ids)) for e in edits),
                                     held=prepared.held)   # the branch's previous prompt: what is held
        job = ReuseJob(cfg, engine, body, prepared, edits, params, blend, model_path, salts)
        primed_tokens = len(job.replacement_ids)
        primed = await job.prime() if reuse.primes(primed_tokens) else None
        KV_EDITS.labels(reuse.name).inc()
        KV_PRIMED.inc(primed_tokens)
        done = {"mode": reuse.name, "primed_tokens": primed_tokens}
        limit, report = await reuse.refine(job, primed)
        params = dataclasses.replace(params, limit=limit)
        done.update(report)
        for kv in _kv_reports(prepared):
            kv.update(done)
    body["kv_transfer_params"] = params.to_wire()


async def _blend(cfg, engine, body: dict, params: Params, prepared, edits, reps: list[int], primed: Primed | None,
                 blend: KVBlend, model_path: str | None, salt: str) -> tuple[int | None, dict]:
    """Choose the ranges to recompute and run the passes that recompute those in the middle.
    Returns the request's own ``limit`` and what it did, for the edit's ``kv`` report."""
    strategy = blend.strategy or cfg.blend_strategy
    fraction = cfg.blend_fraction if blend.fraction is None else blend.fraction
    out: dict = {"strategy": strategy, "fraction": fraction}
    if primed is None or not primed.block_size or not primed.held_tokens:   # nothing held: the connector says why
        return None, out
    bs, held_tokens = primed.block_size, primed.held_tokens
    sp = kv_blend.splice(prepared.old_ids, edits)
    deviation = None
    probed = len(prepared.old_ids) + len(sp.ids) + edits[0].start + len(reps)
    if strategy == "deviation" and fraction > 0 and probed > PROBE_MAX_TOKENS:
        out["blend_error"] = f"probe: {probed} tokens to run, over its bound of {PROBE_MAX_TOKENS}"
        strategy = "tail"
    elif strategy == "deviation" and fraction > 0:
        t0 = time.perf_counter()
        try:
            from .probe import probe_for

            loop = asyncio.get_running_loop()
            probe = await loop.run_in_executor(_PROBE, probe_for, model_path)
            prime_ids = prepared.old_ids[:edits[0].start] + reps
            deviation = await loop.run_in_executor(_PROBE, probe.deviation, prepared.old_ids, prime_ids, sp)
        except Exception as exc:  # no probe for this model: the tail is recomputed instead
            log.warning("session %s: deviation probe failed (%s): recomputing the tail", prepared.session_id, exc)
            out["blend_error"] = f"probe: {exc.__class__.__name__}: {exc}"[:300]
            strategy = "tail"
        out["probe_s"] = round(time.perf_counter() - t0, 4)
    pl = kv_blend.plan(strategy, fraction, sp, bs, held_tokens, deviation)
    reused = computed = 0
    for limit, end in pl.passes:
        req = {"model": body["model"], "prompt": sp.ids[:end], "max_tokens": 1, "cache_salt": salt,
               "kv_transfer_params": dataclasses.replace(params, limit=limit, keep=True).to_wire()}
        status, payload = await engine.post_json("/v1/completions", req)
        if status != 200:
            log.warning("session %s: blend pass answered %s", prepared.session_id, status)
            continue
        usage = payload.get("usage") or {}
        computed += (usage.get("prompt_tokens", 0)
                     - ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        outcome = Outcome.from_wire(payload.get("kv_transfer_params"))
        reused += outcome.reused_tokens if outcome else 0
    return pl.limit, {**out, "block_size": bs, "movable_tokens": pl.movable_tokens,
                      "recompute_tokens": pl.recompute_tokens, "passes": len(pl.passes),
                      "pass_computed_tokens": computed, "pass_reused_tokens": reused}


def take_outcome(kv_transfer_params: dict | None, report: dict | None) -> None:
    """Put the connector's outcome (the engine response's ``kv_transfer_params``) into the edit's
    ``kv`` report (``reused_tokens``, ``fallback``: why it recomputed instead, or null)."""
    outcome = Outcome.from_wire(kv_transfer_params)
    if outcome is None or report is None:
        return
    for edit in report.get("applied_edits", []):
        if "kv" in edit and "fallback" not in edit["kv"]:
            edit["kv"].update(reused_tokens=outcome.reused_tokens, fallback=outcome.fallback)


def continued(kv_transfer_params: dict | None) -> dict | None:
    """The params of a follow-up round (server tools): the edit was the first round's, and this
    prompt holds the server's tool exchange, which the client's next request will not: nothing is
    loaded for it and it is not held (the first round's prompt stays the one the next edit is on)."""
    params = Params.from_wire(kv_transfer_params)
    return Params(params.session, keep=True).to_wire() if params else None
