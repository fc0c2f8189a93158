"""The front's own Prometheus metrics; /metrics serves them after the engine's (vLLM's) metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("agentkv_requests", "HTTP requests answered by the front",
                   ["route", "status"], registry=REGISTRY)
LATENCY = Histogram("agentkv_request_seconds", "Time to answer (to the last byte for streams)",
                    ["route"], registry=REGISTRY)
ENGINE_UP = Gauge("agentkv_engine_up", "1 while the vLLM engine answers /health", registry=REGISTRY)
ENGINE_STARTS = Counter("agentkv_engine_starts", "vLLM engine launches", registry=REGISTRY)


def render(engine_text: str) -> bytes:
    """Prometheus text: vLLM's families (``vllm:*``) followed by ours (``agentkv_*``)."""
    ours = generate_latest(REGISTRY)
    if engine_text and not engine_text.endswith("\n"):
        engine_text += "\n"
    return engine_text.encode() + ours
