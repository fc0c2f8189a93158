"""The summarizer's model: whichever engine the supervisor runs now.

Each engine launch has its own socket and secret, so a client built for one launch fails against the
next. This client looks the engine up at every call and makes a new OpenAI client when it changed.
"""

from __future__ import annotations

import threading

import httpx
from openai import OpenAI

from agentkv.compaction.prompt import Message
from agentkv.compaction.summarize import OpenAIModelClient

from .client import ENGINE_URL
from .process import EngineError, EngineProcess
from .supervisor import Supervisor


class EngineModelClient:
    """A ``compaction.summarize.ModelClient`` over the supervised engine. Called from worker
    threads (the context step runs off the event loop); raises when no engine is serving."""

    def __init__(self, supervisor: Supervisor, model: str):
        self.supervisor, self.model = supervisor, model
        self._lock = threading.Lock()
        self._engine: EngineProcess | None = None
        self._client: OpenAIModelClient | None = None

    def _current(self) -> OpenAIModelClient:
        sup = self.supervisor
        engine = sup.engine
        if engine is None or not sup.healthy():
            raise EngineError(f"the inference engine is {sup.state.value}")
        with self._lock:
            if self._engine is not engine:
                if self._client is not None:
                    self._client.client.close()  # the previous launch's connections
                http = httpx.Client(transport=httpx.HTTPTransport(uds=engine.socket_path), timeout=600)
                api = OpenAI(base_url=f"{ENGINE_URL}/v1", api_key=engine.secret, max_retries=0,
                             http_client=http)  # type: ignore[arg-type]  # typed httpx2.Client; takes httpx's too
                self._client = OpenAIModelClient(api, self.model)
                self._engine = engine
            assert self._client is not None   # made with self._engine, which is engine
            return self._client

    def complete(self, messages: list[Message], max_tokens: int, cache_salt: str | None = None) -> str:
        client = self._current()
        engine = self.supervisor.client
        awaiting = engine.awaiting if engine is not None else None   # work at this launch's engine (the watchdog's)
        if awaiting is not None:
            awaiting.enter()
        try:
            return client.complete(messages, max_tokens, cache_salt)   # not streamed: its answer is all at once
        finally:
            if awaiting is not None:
                awaiting.leave()
