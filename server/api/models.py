"""GET /v1/models: the served model, as the engine lists it."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineUnavailable, unavailable
from .deps import EngineDep, OwnerDep

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(engine: EngineDep, _: OwnerDep) -> Response:
    try:
        status, payload = await engine.get_json("/v1/models")
    except EngineUnavailable as exc:
        return unavailable(exc)
    return JSONResponse(payload, status_code=status)
