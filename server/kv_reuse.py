"""KV reuse after clearing, the front's part: say which edit happened; the connector does the rest.

Every chat request of a session (in ``shift`` or ``blend`` mode) names the session to the engine's
KV connector (``agentkv.kernels.connector``), which holds the blocks of the session's last prompt
in vLLM's pool. When clearing edits the prompt, the front sends the edit: spans of the previous
prompt and how many replacement (placeholder) tokens each got. The placeholders' K/V are computed
by a short priming request first: the shared prefix plus all placeholders back to back, held by the
connector beside the prompt. The connector, which sees vLLM's own token ids and blocks, decides
what it can move and moves it; the rest is computed by vLLM. Its outcome comes back with a
non-streamed response (``kv_transfer_params``) and is counted in the engine's metrics either way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Literal

from .metrics import KV_EDITS, KV_FALLBACKS, KV_PRIMED

Mode = Literal["recompute", "shift", "blend"]
CONNECTOR = {"kv_connector": "AgentKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "agentkv.kernels.connector",
             "kv_load_failure_policy": "recompute"}   # a load that fails late is recomputed, never an error
_KEY = secrets.token_bytes(32)   # session tokens are unguessable by clients (who could send params)

log = logging.getLogger("agentkv.kv_reuse")


def transfer_config(hold_fraction: float, hold_ttl_s: float, blend_fraction: float) -> dict:
    """vLLM's ``--kv-transfer-config`` for agentkv's connector."""
    return dict(CONNECTOR, kv_connector_extra_config={"hold_fraction": hold_fraction, "hold_ttl_s": hold_ttl_s,
                                                      "blend_fraction": blend_fraction})


def session_token(session: str) -> str:
    """What the connector knows a session by: a keyed digest of its storage key (owner/id)."""
    return hmac.new(_KEY, session.encode(), hashlib.sha256).hexdigest()[:32]


def _kv_reports(prepared) -> list[dict]:
    return [e.setdefault("kv", {}) for e in prepared.report["applied_edits"] if e["type"].startswith("clear_tool_uses")]  # agentkv's name or Anthropic's


async def attach(cfg, engine, body: dict, session: str, prepared, mode: Mode | None) -> None:
    """Set the engine request's ``kv_transfer_params``; after clearing, run the priming request
    first. ``mode``: the request's, else the server's. Records the edit in the report."""
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
        if reps:
            prime = {"model": body["model"], "prompt": prepared.old_ids[:edits[0].start] + reps, "max_tokens": 1,
                     "kv_transfer_params": {"agentkv": {"session": params["session"], "prime": True}}}
            if body.get("cache_salt"):  # the same salt: the prefix is a cache hit
                prime["cache_salt"] = body["cache_salt"]
            status, _ = await engine.post_json("/v1/completions", prime)
            if status != 200:   # the connector then finds no priming prompt and says so
                log.warning("session %s: priming request answered %s", prepared.session_id, status)
        KV_EDITS.labels(mode).inc()
        KV_PRIMED.inc(len(reps))
        for kv in _kv_reports(prepared):
            kv.update(mode=mode, primed_tokens=len(reps))
    body["kv_transfer_params"] = {"agentkv": params}


def take_outcome(payload: dict, report: dict | None) -> None:
    """Move the connector's outcome from the engine's response into the edit's ``kv`` report
    (``reused_tokens``, ``fallback``: why it recomputed instead, or null)."""
    outcome = ((payload.pop("kv_transfer_params", None) or {}).get("agentkv")) or None
    if outcome is None or report is None:
        return
    for edit in report.get("applied_edits", []):
        if "kv" in edit and "fallback" not in edit["kv"]:
            edit["kv"].update(reused_tokens=outcome.get("reused_tokens", 0), fallback=outcome.get("fallback"))
