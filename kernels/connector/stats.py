"""What the connector reports through vLLM's own stats path: per-request outcomes counted by the
scheduler side, shipped as ``KVConnectorStats`` with the scheduler's stats, and exported by the
API server's Prometheus registry (vLLM's ``/metrics``, which agentkv's ``/metrics`` includes):

- ``vllm:agentkv_kv_fallbacks_total{reason}``: requests with an edit whose K/V the connector
  could not supply, so vLLM recomputed them, by reason (``params.FALLBACKS``);
- ``vllm:agentkv_kv_reused_tokens_total``: prompt tokens whose K/V the connector moved;
- ``vllm:agentkv_kv_held_blocks``: block references held now;
- retention (turns with no edit): ``vllm:agentkv_kv_retained_tokens_total``, ``..._retained_turns_total``
  and ``..._retain_failed_total``;
- ``vllm:agentkv_kv_scheduled_tokens_total``: tokens the scheduler gave its steps (the stall
  watchdog's step-level progress: vLLM's own prompt counter moves only when a whole prefill ends);
- the host tier (``host_tier``): ``vllm:agentkv_kv_spilled_blocks_total``, ``..._restored_blocks_total``,
  ``..._dropped_blocks_total`` and ``..._restores_total`` (counted by the scheduler side),
  ``vllm:agentkv_kv_host_blocks`` (in use now), and from the worker side, summed over workers,
  ``..._restore_bytes_total`` and ``..._restore_seconds_total`` (bytes and time per restore are
  their ratios to the restores; with several workers the seconds are worker-seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .params import FALLBACKS

COUNTERS = ("spilled_blocks", "restored_blocks", "dropped_blocks", "restores", "restore_bytes", "restore_seconds",
            "retained_tokens", "retained_turns", "retain_failed", "scheduled_tokens")
GAUGES = ("held_blocks", "host_blocks")
_HELP = {
    "spilled_blocks": "KV blocks of held prompts copied to agentkv's host tier as vLLM took them back",
    "restored_blocks": "KV blocks agentkv's connector read back from its host tier for a session's next turn",
    "dropped_blocks": "KV blocks the host tier could not keep (full, or an entry larger than it)",
    "restores": "Loads that read K/V from agentkv's host tier",
    "restore_bytes": "Bytes of K/V moved from agentkv's host tier into vLLM's blocks",
    "restore_seconds": "Seconds the workers spent moving K/V from the host tier into vLLM's blocks (summed)",
    "retained_tokens": "Prompt tokens of turns with no edit whose K/V agentkv's connector read back from the "
                       "session's held prompt (pool or host tier) past vLLM's own prefix hit",
    "retained_turns": "Turns with no edit that read back K/V of the session's held prompt",
    "retain_failed": "Turns with no edit whose read-back failed on a worker (vLLM recomputed them)",
    "scheduled_tokens": "Tokens vLLM's scheduler gave its steps, prefill chunks and decodes alike (agentkv's stall "
                        "watchdog reads it as the engine's step-level progress)",
    "held_blocks": "KV block references agentkv's connector holds for sessions' next turns",
    "host_blocks": "Blocks of agentkv's host tier in use",
}


@dataclass
class AgentKVStats(KVConnectorStats):
    """``data``: ``{"fallbacks": {reason: n}, "reused_tokens": n, ...}`` since the last report: the
    ``COUNTERS`` summed, the ``GAUGES`` (``held_blocks``, ``host_blocks``) their latest value."""

    data: dict[str, Any] = field(default_factory=lambda: {"fallbacks": {}, "reused_tokens": 0})

    def count(self, fallback: str | None, reused: int) -> None:
        if fallback is not None:
            self.data["fallbacks"][fallback] = self.data["fallbacks"].get(fallback, 0) + 1
        self.data["reused_tokens"] += reused

    def add(self, name: str, value: float) -> None:
        """Add to one of the ``COUNTERS``."""
        if value:
            self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {"fallbacks": {}, "reused_tokens": 0}

    def aggregate(self, other: KVConnectorStats) -> AgentKVStats:
        if isinstance(other, AgentKVStats):
            for reason, n in other.data.get("fallbacks", {}).items():
                self.data["fallbacks"][reason] = self.data["fallbacks"].get(reason, 0) + n
            self.data["reused_tokens"] += other.data.get("reused_tokens", 0)
            for name in COUNTERS:
                self.add(name, other.data.get(name, 0))
            for name in GAUGES:
                if name in other.data:
                    self.data[name] = other.data[name]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"reused_tokens": self.data["reused_tokens"]}
        out.update({f"fallback_{r}": n for r, n in self.data["fallbacks"].items()})
        out.update({name: self.data[name] for name in COUNTERS + GAUGES if name in self.data})
        return out

    def is_empty(self) -> bool:
        return not self.data["fallbacks"] and not self.data["reused_tokens"] and not any(
            name in self.data for name in COUNTERS + GAUGES)


class AgentKVPromMetrics(KVConnectorPromMetrics):
    """Registered in vLLM's API server process (``build_prom_metrics``); ``observe`` gets the
    ``data`` dict of ``AgentKVStats``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._fallbacks = self._counter_cls(
            name="vllm:agentkv_kv_fallbacks", labelnames=labelnames + ["reason"],
            documentation="Requests with an edit whose K/V agentkv's connector could not supply "
                          "(vLLM recomputed them), by reason")
        self._reused = self.make_per_engine(self._counter_cls(
            name="vllm:agentkv_kv_reused_tokens", labelnames=labelnames,
            documentation="Prompt tokens whose K/V agentkv's connector moved after an edit"))
        self._counters = {name: self.make_per_engine(self._counter_cls(
            name=f"vllm:agentkv_kv_{name}", labelnames=labelnames, documentation=_HELP[name])) for name in COUNTERS}
        self._gauges = {name: self.make_per_engine(self._gauge_cls(
            name=f"vllm:agentkv_kv_{name}", labelnames=labelnames, multiprocess_mode="mostrecent",
            documentation=_HELP[name])) for name in GAUGES}
        for values in per_engine_labelvalues.values():   # every reason shows, zero or not
            for reason in FALLBACKS:
                self._fallbacks.labels(*values, reason)

    def make_per_engine(self, metric):
        return {engine: metric.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for reason, n in transfer_stats_data.get("fallbacks", {}).items():
            self._fallbacks.labels(*values, reason).inc(n)
        if transfer_stats_data.get("reused_tokens"):
            self._reused[engine_idx].inc(transfer_stats_data["reused_tokens"])
        for name in COUNTERS:
            if transfer_stats_data.get(name):
                self._counters[name][engine_idx].inc(transfer_stats_data[name])
        for name in GAUGES:
            if name in transfer_stats_data:
                self._gauges[name][engine_idx].set(transfer_stats_data[name])
