"""FastAPI dependencies: the engine client (503 while it is not ready), the context manager and
API-key auth; the app's state they read is ``state.AppState``.

All are ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per
dependency per request; these never block (the context manager's one-time build runs in a thread).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Annotated

from fastapi import Depends, Request

from agentkv.server.edge import OWNER, owner_of_key
from agentkv.server.engine.client import EngineClient
from agentkv.server.engine.supervisor import Supervisor
from agentkv.server.errors import ENGINE_RETRY_AFTER_S, APIError
from agentkv.server.pipeline.context import ContextManager
from agentkv.server.pipeline.state import AppState, app_state
from agentkv.server.render.engine_chat import EngineChat

log = logging.getLogger(__name__)


async def get_supervisor(request: Request) -> Supervisor:
    return app_state(request).supervisor


async def owner_of(request: Request) -> str:
    """Who is calling: a digest of the API key (``local`` when the server takes no keys). The edge
    checked the key before the body was read (``edge.Edge``); sessions, salts and caches are
    namespaced by the owner, so one key never sees another's."""
    owner = (request.scope.get("state") or {}).get(OWNER)
    if owner is None:   # a route the edge did not guard: check here
        keys = app_state(request).cfg.api_key
        owner = owner_of_key(keys, request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))
        if owner is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return owner


async def get_engine(sup: Annotated[Supervisor, Depends(get_supervisor)]) -> EngineClient:
    if not sup.healthy() or sup.client is None:
        detail = f" ({sup.error})" if sup.error else ""
        raise APIError(503, f"the inference engine is {sup.state.value}{detail}", code="engine_unavailable",
                       headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    return sup.client


async def get_context(request: Request, engine: Annotated[EngineClient, Depends(get_engine)]) -> ContextManager:
    """The context manager, made once the engine is up (it needs the model's tokenizer)."""
    state = app_state(request)
    if state.context is None:
        return await asyncio.to_thread(_make_context, state)
    return state.context


async def warm_context(state: AppState) -> None:
    """Build the context manager (its tokenizer, transformers' import: seconds) while the engine
    starts, so the first request does not wait for it; a failure here is the first request's to report."""
    await state.supervisor.model_known.wait()
    try:
        await asyncio.to_thread(_make_context, state)
    except Exception:  # noqa: BLE001 - get_context tries again and answers with the error
        log.warning("the context manager could not be built yet", exc_info=True)
        return
    # what start-up built (transformers, the tokenizer: millions of objects) lives as long as the
    # server: out of the collector's sight, a full collection no longer walks it (it cost the front
    # ~9% of its CPU under load; vLLM's API server does the same)
    gc.collect()
    gc.freeze()


def _engine_chat(state: AppState, model_path: str) -> EngineChat | None:
    """vLLM's chat render for the engine the supervisor starts (None, said once, where it cannot be
    built: every prompt then goes to vLLM as messages and the front counts with transformers)."""
    from agentkv.server.engine.process import engine_args, resolve_device

    cfg = state.cfg
    try:
        return EngineChat(engine_args(cfg, model_path, resolve_device(cfg.device), "front.sock"), cfg.model_name)
    except Exception:  # noqa: BLE001 - an engine configuration vLLM's render cannot be built for here
        log.warning("the front could not build vLLM's renderer for this engine", exc_info=True)
        return None


def _make_context(state: AppState) -> ContextManager:
    if state.context is None:
        with state.context_lock:
            if state.context is None:
                from agentkv.compaction.prompt import PromptRenderer
                from agentkv.server.engine.summarizer import EngineModelClient
                from agentkv.server.pipeline.engine_input import EngineInput
                from agentkv.server.render.engine_chat import counting_renderer

                sup, cfg = state.supervisor, state.cfg
                model_path = sup.model_path   # known: warm_context waits for model_known, get_context for the engine
                assert model_path is not None
                chat = _engine_chat(state, model_path)
                renderer = counting_renderer(chat) if chat is not None and chat.hf else \
                    PromptRenderer.from_pretrained(model_path)
                state.engine_input = EngineInput(cfg.engine_input, chat)
                state.context = ContextManager(state.sessions, renderer, EngineModelClient(sup, cfg.model_name),
                                               shared_caches=not cfg.api_key)
    return state.context


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
EngineDep = Annotated[EngineClient, Depends(get_engine)]
ContextDep = Annotated[ContextManager, Depends(get_context)]
OwnerDep = Annotated[str, Depends(owner_of)]
Authorized = Depends(owner_of)
