"""The front's own Prometheus metrics; /metrics serves them after the engine's (vLLM's) metrics."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import timing

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("agentkv_requests", "HTTP requests answered by the front",
                   ["route", "status"], registry=REGISTRY)
LATENCY = Histogram("agentkv_request_seconds", "Time to answer (to the last byte for streams)",
                    ["route"], registry=REGISTRY)
ENGINE_UP = Gauge("agentkv_engine_up", "1 while the vLLM engine answers /health", registry=REGISTRY)
ENGINE_STARTS = Counter("agentkv_engine_starts", "vLLM engine launches", registry=REGISTRY)
ENGINE_RESTARTS = Counter("agentkv_engine_restarts", "vLLM engine relaunches after it exited",
                          registry=REGISTRY)
KV_EDITS = Counter("agentkv_kv_edits", "Clearing edits sent to the KV connector for reuse (the engine's "
                   "vllm:agentkv_kv_reused_tokens and vllm:agentkv_kv_fallbacks count what came of them)", ["mode"],
                   registry=REGISTRY)
KV_FALLBACKS = Counter("agentkv_kv_fallbacks", "Edits the front recomputed without asking the connector, by "
                       "reason (connector_disabled: the server runs without it)", ["reason"], registry=REGISTRY)
KV_PRIMED = Counter("agentkv_kv_primed_tokens", "Prompt tokens of priming requests (placeholders computed "
                    "for shifting)", registry=REGISTRY)
ENGINE_INPUT = Counter("agentkv_engine_input_requests", "Chat requests sent to the engine by the form of their "
                       "prompt (tokens: the front's ids, vLLM's own render; messages: vLLM renders them) and why "
                       "they went as messages (server: --engine-input messages; request: the request's "
                       "engine_input; field:<name>: a field with which vLLM renders itself; non_text_content; "
                       "renderer: harmony, a renderer mode other than HF's, a template reading the clock, or no "
                       "renderer in the front; refused: vLLM's preprocessing refuses the request, the engine "
                       "answers it)", ["input", "reason"], registry=REGISTRY)
ENGINE_STALLS = Counter("agentkv_engine_stalls", "vLLM engines killed and relaunched because they made no "
                        "progress (--engine-stall-s)", registry=REGISTRY)
PROMPT_TOKENS = Counter("agentkv_prompt_tokens", "Chat prompt tokens by how the engine got their K/V "
                        "(cached: prefix cache or connector; computed: prefilled)", ["source"], registry=REGISTRY)


class RequestMetrics:
    """ASGI middleware counting requests by route and status and timing each to its last byte;
    the response says where its time went before it started (``Server-Timing``, see ``timing``).
    Pure ASGI: a streamed body passes through with one extra call per message (Starlette's
    ``BaseHTTPMiddleware`` moves every chunk through a memory stream and a task instead)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, marks = None, timing.start()
        t0 = marks["arrived"]

        async def send_(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                spent = timing.header(marks)
                if spent is not None:
                    message = {**message, "headers": [*message.get("headers", ()), (b"server-timing", spent)]}
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            if status is not None:
                path = getattr(scope.get("route"), "path", "unmatched")
                REQUESTS.labels(path, str(status)).inc()
                LATENCY.labels(path).observe(time.perf_counter() - t0)


def observe_usage(usage: dict | None) -> None:
    if not usage:
        return
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    PROMPT_TOKENS.labels("cached").inc(cached)
    PROMPT_TOKENS.labels("computed").inc(max(0, usage.get("prompt_tokens", 0) - cached))


def render(engine_text: str) -> bytes:
    """Prometheus text: vLLM's families (``vllm:*``) followed by ours (``agentkv_*``)."""
    ours = generate_latest(REGISTRY)
    if engine_text and not engine_text.endswith("\n"):
        engine_text += "\n"
    return engine_text.encode() + ours
