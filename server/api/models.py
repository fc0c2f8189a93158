"""GET /v1/models: the served model, as the engine lists it (with its window, ``max_model_len``).

Codex asks ``GET /models?client_version=...`` for its own model catalog: that form also gets a
top-level ``models`` array of Codex's ``ModelInfo`` for the served model, carrying the real context
window (and the token count at which Codex should compact, the server's ``--compact-at``). It
carries no ``base_instructions``: Codex keeps its own prompt (a catalog's instructions would
replace it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentkv.server.engine.client import EngineUnavailable, unavailable
from agentkv.server.pipeline.state import app_state

from .deps import EngineDep, OwnerDep

router = APIRouter(prefix="/v1")


def codex_model_info(model: dict, compact_at: float) -> dict:
    """Codex's ``ModelInfo`` (codex-rs ``protocol::openai_models``) for one served model. Codex
    compacts by itself at ``compact_at`` of the window (agentkv's default summarizes at that
    fraction of the room its system prompt and tools leave, never earlier)."""
    window = model.get("max_model_len")
    return {"slug": model["id"], "display_name": model["id"], "description": "served by agentkv",
            "supported_reasoning_levels": [], "shell_type": "shell_command", "visibility": "list",
            "supported_in_api": True, "priority": 0, "upgrade": None, "supports_reasoning_summaries": False,
            "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": "function",
            "truncation_policy": {"mode": "tokens", "limit": 10_000}, "supports_parallel_tool_calls": True,
            "context_window": window, "auto_compact_token_limit": int(window * compact_at) if window else None,
            "effective_context_window_percent": 95, "experimental_supported_tools": [], "input_modalities": ["text"]}


@router.get("/models")
async def models(request: Request, engine: EngineDep, _: OwnerDep) -> Response:
    try:
        status, payload = await engine.get_json("/v1/models")
    except EngineUnavailable as exc:
        return unavailable(exc)
    cfg = app_state(request).cfg
    if status == 200 and isinstance(payload, dict):
        for m in payload.get("data") or []:   # what `agentkv launch` checks before it starts a client
            m["agentkv"] = {"tool_calls": bool(cfg.tool_call_parser), "context_management": cfg.context_management}
    if status == 200 and "client_version" in request.query_params and isinstance(payload, dict):
        payload["models"] = [codex_model_info(m, cfg.compact_at) for m in payload.get("data") or []]
    return JSONResponse(payload, status_code=status)
