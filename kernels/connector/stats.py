"""What the connector reports through vLLM's own stats path: per-request outcomes counted by the
scheduler side, shipped as ``KVConnectorStats`` with the scheduler's stats, and exported by the
API server's Prometheus registry (vLLM's ``/metrics``, which agentkv's ``/metrics`` includes):

- ``vllm:agentkv_kv_fallbacks_total{reason}``: requests with an edit whose K/V the connector
  could not supply, so vLLM recomputed them, by reason (``params.FALLBACKS``);
- ``vllm:agentkv_kv_reused_tokens_total``: prompt tokens whose K/V the connector moved;
- ``vllm:agentkv_kv_held_blocks``: block references held now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .params import FALLBACKS


@dataclass
class AgentKVStats(KVConnectorStats):
    """``data``: ``{"fallbacks": {reason: n}, "reused_tokens": n, "held_blocks": n}`` since the last
    report (``held_blocks``: the latest value)."""

    data: dict[str, Any] = field(default_factory=lambda: {"fallbacks": {}, "reused_tokens": 0})

    def count(self, fallback: str | None, reused: int) -> None:
        if fallback is not None:
            self.data["fallbacks"][fallback] = self.data["fallbacks"].get(fallback, 0) + 1
        self.data["reused_tokens"] += reused

    def reset(self) -> None:
        self.data = {"fallbacks": {}, "reused_tokens": 0}

    def aggregate(self, other: KVConnectorStats) -> AgentKVStats:
        if isinstance(other, AgentKVStats):
            for reason, n in other.data.get("fallbacks", {}).items():
                self.data["fallbacks"][reason] = self.data["fallbacks"].get(reason, 0) + n
            self.data["reused_tokens"] += other.data.get("reused_tokens", 0)
            if "held_blocks" in other.data:
                self.data["held_blocks"] = other.data["held_blocks"]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"reused_tokens": self.data["reused_tokens"]}
        out.update({f"fallback_{r}": n for r, n in self.data["fallbacks"].items()})
        if "held_blocks" in self.data:
            out["held_blocks"] = self.data["held_blocks"]
        return out

    def is_empty(self) -> bool:
        return not self.data["fallbacks"] and not self.data["reused_tokens"] and "held_blocks" not in self.data


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
        self._held = self.make_per_engine(self._gauge_cls(
            name="vllm:agentkv_kv_held_blocks", labelnames=labelnames, multiprocess_mode="mostrecent",
            documentation="KV block references agentkv's connector holds for sessions' next turns"))
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
        if "held_blocks" in transfer_stats_data:
            self._held[engine_idx].set(transfer_stats_data["held_blocks"])
