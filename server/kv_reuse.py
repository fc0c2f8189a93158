"""KV reuse after clearing, the front's part: say which edit happened; the connector does the rest.

Every chat request of a session (in ``shift`` or ``blend`` mode) names the session to the engine's
KV connector (``agentkv.kernels.connector``), which holds the blocks of the session's last prompt
in vLLM's pool. When clearing edits the prompt, the front sends the edit: spans of the previous
prompt and how many replacement (placeholder) tokens each got. The placeholders' K/V are computed
by a short priming request first: the shared prefix plus all placeholders back to back, held by the
connector beside the prompt. The connector, which sees vLLM's own token ids and blocks, decides
what it can move and moves it; the rest is computed by vLLM. Its outcome comes back with a
non-streamed response (``kv_transfer_params``) and is counted in the engine's metrics either way.
``blend`` also recomputes a share of the moved tokens, chosen by a strategy (``kv_blend``), with
passes run here before the request (see ``kv_blend``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from typing import Literal

from . import kv_blend
from .kv_blend import KVBlend
from .metrics import KV_EDITS, KV_FALLBACKS, KV_PRIMED

Mode = Literal["recompute", "shift", "blend"]
CONNECTOR = {"kv_connector": "AgentKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "agentkv.kernels.connector",
             "kv_load_failure_policy": "recompute"}   # a load that fails late is recomputed, never an error
_KEY = secrets.token_bytes(32)   # session tokens are unguessable by clients (who could send params)

log = logging.getLogger("agentkv.kv_reuse")


def transfer_config(hold_fraction: float, hold_ttl_s: float) -> dict:
    """vLLM's ``--kv-transfer-config`` for agentkv's connector."""
    return dict(CONNECTOR, kv_connector_extra_config={"hold_fraction": hold_fraction, "hold_ttl_s": hold_ttl_s})


def session_token(session: str) -> str:
    """What the connector knows a session by: a keyed digest of its storage key (owner/id)."""
    return hmac.new(_KEY, session.encode(), hashlib.sha256).hexdigest()[:32]


def _kv_reports(prepared) -> list[dict]:
    return [e.setdefault("kv", {}) for e in prepared.report["applied_edits"] if e["type"].startswith("clear_tool_uses")]  # agentkv's name or Anthropic's


async def attach(cfg, engine, body: dict, session: str, prepared, mode: Mode | None,
                 blend: KVBlend | None = None, model_path: str | None = None) -> None:
    """Set the engine request's ``kv_transfer_params``; after clearing, run the priming request
    (and blend's passes) first. ``mode`` / ``blend``: the request's, else the server's;
    ``model_path``: the served model (the deviation probe loads its first layers). Records the edit
    in the report."""
    mode = mode or cfg.kv_reuse
    if not cfg.kv_connector:
        if mode != "recompute" and prepared.edits:
            log.warning("kv_reuse %s asked (session %s), but this server runs without the KV connector "
                        "(--kv-reuse recompute): recomputing", mode, prepared.session_id)
            KV_FALLBACKS.labels("connector_disabled").inc()
            for kv in _kv_reports(prepared):
                kv.update(mode="recompute", requested=mode, fallback="connector_disabled")
        return
    if mode == "recompute":
        return
    params: dict = {"session": session_token(session)}
    if prepared.edits:
        edits = sorted(prepared.edits, key=lambda e: e.start)
        params.update(mode=mode, spans=[[e.start, e.end, len(e.replacement_ids)] for e in edits])
        reps = [t for e in edits for t in e.replacement_ids]
        held: dict = {}
        if reps or mode == "blend":   # blend plans with what the priming response says
            prime = {"model": body["model"], "prompt": prepared.old_ids[:edits[0].start] + reps, "max_tokens": 1,
                     "kv_transfer_params": {"agentkv": {"session": params["session"], "prime": True}}}
            if body.get("cache_salt"):  # the same salt: the prefix is a cache hit
                prime["cache_salt"] = body["cache_salt"]
            status, payload = await engine.post_json("/v1/completions", prime)
            if status != 200:   # the connector then finds no priming prompt and says so
                log.warning("session %s: priming request answered %s", prepared.session_id, status)
            else:
                held = ((payload.get("kv_transfer_params") or {}).get("agentkv")) or {}
        KV_EDITS.labels(mode).inc()
        KV_PRIMED.inc(len(reps))
        done = {"mode": mode, "primed_tokens": len(reps)}
        if mode == "blend":
            done.update(await _blend(cfg, engine, body, params, prepared, edits, reps, held, blend or KVBlend(),
                                     model_path))
        for kv in _kv_reports(prepared):
            kv.update(done)
    body["kv_transfer_params"] = {"agentkv": params}


async def _blend(cfg, engine, body: dict, params: dict, prepared, edits, reps: list[int], held: dict,
                 blend: KVBlend, model_path: str | None) -> dict:
    """Choose the ranges to recompute and run the passes that recompute those in the middle; set
    the request's own ``limit``. Returns what it did, for the edit's ``kv`` report."""
    strategy = blend.strategy or cfg.blend_strategy
    fraction = cfg.blend_fraction if blend.fraction is None else blend.fraction
    out: dict = {"strategy": strategy, "fraction": fraction}
    bs, held_tokens = held.get("block_size"), held.get("held_tokens", 0)
    if not bs or not held_tokens:   # nothing held: the connector falls back and says why
        return out
    sp = kv_blend.splice(prepared.old_ids, edits)
    deviation = None
    if strategy == "deviation" and fraction > 0:
        t0 = time.perf_counter()
        try:
            from .kv_probe import probe_for

            probe = await asyncio.to_thread(probe_for, model_path)
            prime_ids = prepared.old_ids[:edits[0].start] + reps
            deviation = await asyncio.to_thread(probe.deviation, prepared.old_ids, prime_ids, sp)
        except Exception as exc:  # no probe for this model: the tail is recomputed instead
            log.warning("session %s: deviation probe failed (%s): recomputing the tail", prepared.session_id, exc)
            out["blend_error"] = f"probe: {exc.__class__.__name__}: {exc}"[:300]
            strategy = "tail"
        out["probe_s"] = round(time.perf_counter() - t0, 4)
    pl = kv_blend.plan(strategy, fraction, sp, bs, held_tokens, deviation)
    reused = computed = 0
    for limit, end in pl.passes:
        req = {"model": body["model"], "prompt": sp.ids[:end], "max_tokens": 1,
               "kv_transfer_params": {"agentkv": {**params, "limit": limit, "pass": True}}}
        if body.get("cache_salt"):
            req["cache_salt"] = body["cache_salt"]
        status, payload = await engine.post_json("/v1/completions", req)
        if status != 200:
            log.warning("session %s: blend pass answered %s", prepared.session_id, status)
            continue
        usage = payload.get("usage") or {}
        computed += usage.get("prompt_tokens", 0) - ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reused += (((payload.get("kv_transfer_params") or {}).get("agentkv")) or {}).get("reused_tokens", 0)
    if pl.limit is not None:
        params["limit"] = pl.limit
    return {**out, "block_size": bs, "movable_tokens": pl.movable_tokens, "recompute_tokens": pl.recompute_tokens,
            "passes": len(pl.passes),
            "pass_computed_tokens": computed, "pass_reused_tokens": reused}


def take_outcome(kv_transfer_params: dict | None, report: dict | None) -> None:
    """Put the connector's outcome (the engine response's ``kv_transfer_params``) into the edit's
    ``kv`` report (``reused_tokens``, ``fallback``: why it recomputed instead, or null)."""
    outcome = ((kv_transfer_params or {}).get("agentkv")) or None
    if outcome is None or report is None:
        return
    for edit in report.get("applied_edits", []):
        if "kv" in edit and "fallback" not in edit["kv"]:
            edit["kv"].update(reused_tokens=outcome.get("reused_tokens", 0), fallback=outcome.get("fallback"))
