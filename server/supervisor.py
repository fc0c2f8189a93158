"""Owns the engine's life: resolve the model, launch vLLM in the background, report its state."""

from __future__ import annotations

import asyncio
import logging
from enum import Enum
from pathlib import Path

from .config import ServeConfig, agentkv_home
from .embedded_model import TinyModelSpec, build_model
from .engine import EngineError, EngineProcess, resolve_device
from .metrics import ENGINE_STARTS, ENGINE_UP
from .proxy import EngineClient

log = logging.getLogger("agentkv.supervisor")


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


def embedded_model_dir(spec: TinyModelSpec = TinyModelSpec()) -> Path:
    return agentkv_home() / "models" / spec.name


def resolve_model_path(cfg: ServeConfig) -> str:
    """The path or hub id vLLM loads: ``--model``, or the embedded model (built on first use)."""
    if cfg.model:
        return cfg.model
    return str(build_model(embedded_model_dir()))


class Supervisor:
    """Created once per app. `start()` returns at once; the engine comes up in the background."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.state = EngineState.STOPPED
        self.error: str | None = None
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self._task: asyncio.Task | None = None
        self.model_path: str | None = None
        self.max_model_len: int = 0

    def start(self) -> None:
        self.state = EngineState.STARTING
        self._task = asyncio.create_task(self._launch())

    async def _launch(self) -> None:
        try:
            self.model_path = await asyncio.to_thread(resolve_model_path, self.cfg)
            self.engine = EngineProcess(self.cfg, self.model_path, resolve_device(self.cfg.device))
            ENGINE_STARTS.inc()
            await self.engine.start()
            self.client = EngineClient(self.engine.base_url, self.engine.secret)
            _, models = await self.client.get_json("/v1/models")
            self.max_model_len = int(models["data"][0]["max_model_len"])
            self.state = EngineState.READY
            ENGINE_UP.set(1)
        except (EngineError, OSError, ValueError, KeyError) as exc:
            log.error("engine failed to start: %s", exc)
            self.state, self.error = EngineState.FAILED, str(exc)

    def healthy(self) -> bool:
        ok = self.state is EngineState.READY and self.engine is not None and self.engine.alive()
        if self.state is EngineState.READY and not ok:
            self.state, self.error = EngineState.FAILED, "the vLLM engine process exited"
            ENGINE_UP.set(0)
        return ok

    async def stop(self) -> None:
        if self._task and not self._task.done():
            self._task.cancel()
        if self.client:
            await self.client.aclose()
        if self.engine:
            await asyncio.to_thread(self.engine.stop)
        self.state = EngineState.STOPPED
        ENGINE_UP.set(0)
