"""The FastAPI app: wiring only (lifespan, error handlers, routers, /health, /metrics)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from agentkv.compaction.log.open import is_postgres_url, open_session_log

from .api import completions, models, sessions
from .api.chat import router as chat
from .api.deps import Authorized, SupervisorDep, warm_context
from .api.messages import router as messages
from .api.responses import router as responses
from .api.ui import router as ui
from .config import ServeConfig
from .edge import Edge, owners_of_keys
from .engine.client import EngineUnavailable
from .engine.supervisor import EngineState, Supervisor
from .errors import LastResort, install_error_handlers
from .metrics import RequestMetrics, render
from .pipeline.compaction_item import CompactionSeal, load_key
from .pipeline.sessions import Sessions
from .pipeline.state import AppState
from .ui_auth import UICookie

log = logging.getLogger(__name__)


def create_app(cfg: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.supervisor.start()
        warm = asyncio.create_task(warm_context(state))
        yield
        warm.cancel()
        await state.supervisor.stop()

    app = FastAPI(title="agentkv", version="0.1.0", lifespan=lifespan)
    key = load_key(path=cfg.compaction_key_file)
    state = AppState(cfg, Supervisor(cfg), Sessions(open_session_log(cfg.session_db_path)),
                     CompactionSeal(key)).install(app)
    app.state.ui_cookie = UICookie(key, owners_of_keys(cfg.api_key)) if cfg.ui else None
    if is_postgres_url(cfg.session_db_path) and not cfg.compaction_key_file:
        log.warning("the session log is on PostgreSQL, which replicas share, but --compaction-key-file is not set: "
                    "this replica signs compaction items with a key of its own (in $AGENTKV_HOME), and the other "
                    "replicas will refuse them; give every replica the same key file (docs/deploy.md)")
    install_error_handlers(app)
    app.add_middleware(Edge, max_bytes=int(cfg.max_request_mb * 2**20), keys=cfg.api_key,
                       body_timeout_s=cfg.body_timeout_s, ui=app.state.ui_cookie)
    app.add_middleware(LastResort)
    app.add_middleware(RequestMetrics)
    for api in (chat, completions, models, messages, responses, sessions):
        app.include_router(api.router)
    if cfg.ui:
        app.include_router(ui.router)

    @app.get("/health")
    async def health(sup: SupervisorDep) -> Response:
        ok = sup.healthy()
        state = "restarting" if not ok and sup.state is EngineState.READY else sup.state.value  # not yet seen
        body = {"status": "ok" if ok else state, "model": cfg.model_name}
        if sup.error:
            body["error"] = sup.error
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/health/live")
    async def live(sup: SupervisorDep) -> Response:
        """Liveness: 200 while the engine is up, starting or restarting; 503 once given up on."""
        ok = sup.alive()
        return JSONResponse({"status": "ok" if ok else sup.state.value, "engine": sup.state.value},
                            status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=[Authorized])
    async def metrics(sup: SupervisorDep) -> Response:
        engine_text = ""
        if sup.healthy() and sup.client is not None:
            try:
                _, engine_text = await sup.client.get_text("/metrics")
            except EngineUnavailable:
                engine_text = ""
        return Response(render(engine_text), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
