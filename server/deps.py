"""FastAPI dependencies: the engine client (503 while it is not ready) and API-key auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from .errors import APIError
from .proxy import EngineClient
from .supervisor import Supervisor


def get_supervisor(request: Request) -> Supervisor:
    return request.app.state.supervisor


def require_api_key(request: Request) -> None:
    """With ``--api-key``: ``Authorization: Bearer KEY`` (or ``x-api-key``) is required."""
    key = request.app.state.cfg.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def get_engine(sup: Annotated[Supervisor, Depends(get_supervisor)]) -> EngineClient:
    if not sup.healthy() or sup.client is None:
        detail = f" ({sup.error})" if sup.error else ""
        raise APIError(503, f"the inference engine is {sup.state.value}{detail}", code="engine_unavailable")
    return sup.client


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
EngineDep = Annotated[EngineClient, Depends(get_engine)]
Authorized = Depends(require_api_key)
