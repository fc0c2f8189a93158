"""Owns the engine's life: resolve the model, launch vLLM in the background, watch it, restart it
when it dies (a bounded number of times), and report its state."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

from agentkv.server.config import ServeConfig
from agentkv.server.embedded_model import is_embedded
from agentkv.server.metrics import ENGINE_RESTARTS, ENGINE_STALLS, ENGINE_STARTS, ENGINE_UP

from .client import EngineClient, EngineUnavailable
from .process import EngineError, EngineProcess, resolve_device
from .progress import DEFAULT_STALL_S, EngineReading, ProgressWatch, look, reading_of

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.5
RESTART_WINDOW_S = 3600.0
RELAUNCH_DELAY_S = 2.0  # after a relaunch that failed, before the next try
METRICS_DEADLINE_S = 5.0   # the stall watchdog's read of the engine's counters


def read_every_s(stall_s: float) -> float:
    """How often the watchdog reads the engine's counters while it has work: often enough to judge
    a stretch of ``stall_s``, rarely enough to cost the engine nothing (6 s at the default 120 s)."""
    return min(6.0, max(WATCH_INTERVAL_S, stall_s / 20))


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # the engine died; a new one is coming up
    FAILED = "failed"          # it will not come back without an operator
    STOPPED = "stopped"


def resolve_model_path(cfg: ServeConfig) -> str:
    """The path or hub id vLLM loads: an embedded model's folder (built on first use), else ``--model``."""
    if is_embedded(cfg.model):
        from agentkv.server.embedded_model.catalog import build

        return str(build(cfg.model))
    return cfg.model


class Supervisor:
    """Created once per app. `start()` returns at once; the engine comes up in the background and
    is watched from then on: when it exits, or makes no progress for ``--engine-stall-s``
    (``progress``: then its process group is killed), in-flight requests fail with a clean error,
    /health turns 503 (``restarting``, the reason in ``error``), and a new engine is launched. Every
    relaunch, the ones that fail included, counts against ``cfg.engine_restarts`` an hour; a relaunch
    that fails is tried again after ``RELAUNCH_DELAY_S`` while that budget lasts. Then, and when the
    very first launch fails (a configuration error, most likely), the state is ``failed``. Nothing
    ends the watch silently: an unexpected error in it is ``failed`` too, with the error on /health."""

    def __init__(self, cfg: ServeConfig, engine_factory: Callable[..., EngineProcess] = EngineProcess):
        self.cfg = cfg
        self.engine_factory = engine_factory  # (cfg, model_path, device) -> EngineProcess
        self.state = EngineState.STOPPED
        self.error: str | None = None
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self._task: asyncio.Task | None = None
        self.model_path: str | None = None
        self.model_known = asyncio.Event()  # set once model_path is (the tokenizer can load meanwhile)
        self.max_model_len: int = 0
        self._crashes: deque[float] = deque()

    def start(self) -> None:
        self.state = EngineState.STARTING
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._supervise()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an unforeseen error: say so on /health, never hang
            log.exception("the engine watchdog failed")
            self.state, self.error = EngineState.FAILED, f"the engine watchdog failed: {exc!r}"
            ENGINE_UP.set(0)

    async def _supervise(self) -> None:
        served = False  # whether any launch came up: a first launch that fails is not retried
        while True:
            failure = await self._launch()
            if failure is None:
                served = True
                assert self.engine is not None   # _launch returns None once self.engine serves
                stuck = await self._watch(self.engine)
                if stuck:
                    self._kill_stuck(stuck)
                    why = stuck
                else:
                    code = self.engine.proc.returncode if self.engine and self.engine.proc else None
                    why = f"the vLLM engine exited (code {code})"
                again = self._may_restart(why)
                await self._discard()
                if not again:
                    return
            elif not served:
                self.state, self.error = EngineState.FAILED, failure
                return
            elif self._may_restart(f"the vLLM engine failed to restart: {failure}"):
                await asyncio.sleep(RELAUNCH_DELAY_S)
            else:
                return

    async def _watch(self, engine: EngineProcess) -> str | None:
        """Wait while the engine lives; None when it exits, else why it is stuck (``progress``)."""
        device = engine.device if engine.device in DEFAULT_STALL_S else "cuda"
        stall_s = self.cfg.engine_stall_s or DEFAULT_STALL_S[device]
        watch, every, next_read = ProgressWatch(stall_s), read_every_s(stall_s), 0.0
        while engine.alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
            if engine.proc is None:
                continue
            procs = await asyncio.to_thread(look, engine.proc.pid)
            awaiting = self.client.awaiting.n if self.client is not None else 0   # this launch's
            read = watch.wants_reading(awaiting) and time.monotonic() >= next_read
            reading = await self._reading() if read else None
            if read:
                next_read = time.monotonic() + every
            stuck = watch.observe(awaiting, procs, reading, read)
            if stuck and engine.alive():
                return stuck
        return None

    async def _reading(self) -> EngineReading | None:
        """The engine's work and progress counters, or None where it does not answer within the deadline."""
        client = self.client
        if client is None:
            return None
        try:
            status, text = await asyncio.wait_for(client.get_text("/metrics"), METRICS_DEADLINE_S)
        except (asyncio.TimeoutError, EngineUnavailable):
            return None
        return reading_of(text) if status == 200 else None

    def _kill_stuck(self, why: str) -> None:
        """Stuck is handled as a crash: refuse new requests at once, kill the engine's whole process
        group (SIGKILL ends stopped processes too); the streams in flight end with an error event
        as their connections close, and the relaunch follows as after an exit."""
        log.error("%s: killing it", why)
        self.state, self.error = EngineState.RESTARTING, f"{why}; restarting"
        ENGINE_UP.set(0)
        ENGINE_STALLS.inc()
        engine = self.engine
        if engine is not None and engine.proc is not None:
            try:
                os.killpg(engine.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.client is not None:
            self.client.fail_open(why)

    def _may_restart(self, failure: str) -> bool:
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > RESTART_WINDOW_S:
            self._crashes.popleft()
        ENGINE_UP.set(0)
        if len(self._crashes) > self.cfg.engine_restarts:
            self.state = EngineState.FAILED
            self.error = (f"{failure}; {len(self._crashes)} engine failures within an hour, not restarting "
                          f"(--engine-restarts {self.cfg.engine_restarts})")
            log.error("%s", self.error)
            return False
        self.state, self.error = EngineState.RESTARTING, f"{failure}; restarting"
        log.error("%s", self.error)
        ENGINE_RESTARTS.inc()
        return True

    async def _discard(self) -> None:
        """Reap what is left of an engine (its process group) and close its client."""
        client, engine, self.client = self.client, self.engine, None
        if client:
            await client.aclose()
        if engine:
            await asyncio.to_thread(engine.stop)

    async def _launch(self) -> str | None:
        """Start an engine and wait until it serves; None when it does, else why not (what was
        started is stopped again)."""
        try:
            if self.model_path is None:
                self.model_path = await asyncio.to_thread(resolve_model_path, self.cfg)
                self.model_known.set()
            self.engine = self.engine_factory(self.cfg, self.model_path, resolve_device(self.cfg.device))
            ENGINE_STARTS.inc()
            await self.engine.start()
            client = EngineClient(self.engine.socket_path, self.engine.secret)
            try:
                _, models = await client.get_json("/v1/models")
                self.max_model_len = int(models["data"][0]["max_model_len"])
            except Exception:
                await client.aclose()
                raise
            self.client = client
            self.state, self.error = EngineState.READY, None
            ENGINE_UP.set(1)
            return None
        except (EngineError, EngineUnavailable, OSError, ValueError, KeyError, TypeError) as exc:
            failure = str(exc)
            log.error("engine failed to start: %s", failure)
            await self._discard()
            return failure

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
