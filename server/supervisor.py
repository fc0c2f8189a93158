"""Owns the engine's life: resolve the model, launch vLLM in the background, watch it, restart it
when it dies (a bounded number of times), and report its state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from enum import Enum

from .config import ServeConfig
from .embedded_model import is_embedded
from .engine import EngineError, EngineProcess, resolve_device
from .metrics import ENGINE_RESTARTS, ENGINE_STARTS, ENGINE_UP
from .proxy import EngineClient

log = logging.getLogger("agentkv.supervisor")
WATCH_INTERVAL_S = 0.5
RESTART_WINDOW_S = 3600.0


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # the engine died; a new one is coming up
    FAILED = "failed"          # it will not come back without an operator
    STOPPED = "stopped"


def resolve_model_path(cfg: ServeConfig) -> str:
    """The path or hub id vLLM loads: an embedded model's folder (built on first use), else ``--model``."""
    if is_embedded(cfg.model):
        from .embedded_model.catalog import build

        return str(build(cfg.model))
    return cfg.model


class Supervisor:
    """Created once per app. `start()` returns at once; the engine comes up in the background and
    is watched from then on: when it exits, in-flight requests fail with a clean error, /health
    turns 503 (``restarting``), and a new engine is launched, up to ``cfg.engine_restarts`` times
    an hour; after that the state is ``failed``."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.state = EngineState.STOPPED
        self.error: str | None = None
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self._task: asyncio.Task | None = None
        self.model_path: str | None = None
        self.max_model_len: int = 0
        self._crashes: deque[float] = deque()

    def start(self) -> None:
        self.state = EngineState.STARTING
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while await self._launch():
            while self.engine is not None and self.engine.alive():
                await asyncio.sleep(WATCH_INTERVAL_S)
            if not self._may_restart():
                return
            await self._discard()

    def _may_restart(self) -> bool:
        code = self.engine.proc.returncode if self.engine and self.engine.proc else None
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > RESTART_WINDOW_S:
            self._crashes.popleft()
        ENGINE_UP.set(0)
        if len(self._crashes) > self.cfg.engine_restarts:
            self.state = EngineState.FAILED
            self.error = (f"the vLLM engine exited (code {code}) {len(self._crashes)} times within an hour; "
                          f"not restarting (--engine-restarts {self.cfg.engine_restarts})")
            log.error("%s", self.error)
            return False
        self.state, self.error = EngineState.RESTARTING, f"the vLLM engine exited (code {code}); restarting"
        log.error("%s", self.error)
        ENGINE_RESTARTS.inc()
        return True

    async def _discard(self) -> None:
        """Reap what is left of a dead engine (its process group) and close its client."""
        client, engine, self.client = self.client, self.engine, None
        if client:
            await client.aclose()
        if engine:
            await asyncio.to_thread(engine.stop)

    async def _launch(self) -> bool:
        try:
            if self.model_path is None:
                self.model_path = await asyncio.to_thread(resolve_model_path, self.cfg)
            self.engine = EngineProcess(self.cfg, self.model_path, resolve_device(self.cfg.device))
            ENGINE_STARTS.inc()
            await self.engine.start()
            client = EngineClient(self.engine.base_url, self.engine.secret)
            _, models = await client.get_json("/v1/models")
            self.max_model_len = int(models["data"][0]["max_model_len"])
            self.client = client
            self.state, self.error = EngineState.READY, None
            ENGINE_UP.set(1)
            return True
        except (EngineError, OSError, ValueError, KeyError) as exc:
            log.error("engine failed to start: %s", exc)
            self.state, self.error = EngineState.FAILED, str(exc)
            if self.engine:
                await asyncio.to_thread(self.engine.stop)
            return False

    def healthy(self) -> bool:
        return self.state is EngineState.READY and self.engine is not None and self.engine.alive()

    def alive(self) -> bool:
        """Liveness: the front is serving and the engine is up or on its way (not given up on)."""
        return self.state in (EngineState.STARTING, EngineState.READY, EngineState.RESTARTING)

    async def stop(self) -> None:
        if self._task and not self._task.done():
            self._task.cancel()
        await self._discard()
        self.state = EngineState.STOPPED
        ENGINE_UP.set(0)
