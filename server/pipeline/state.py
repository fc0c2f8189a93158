"""The app's state, typed: what ``app.create_app`` makes once, the routes read through ``app_state``,
and the pipeline is handed (``turn.prepare_turn``, ``compact.compact_now``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv.server.config import ServeConfig
from agentkv.server.engine.supervisor import Supervisor

from .compaction_item import CompactionSeal
from .sessions import Sessions

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import HTTPConnection

    from .context import ContextManager
    from .engine_input import EngineInput  # imported where it is made (api.deps), not at start-up

ATTRIBUTE = "agentkv"   # the state's name on Starlette's ``app.state``


@dataclass
class AppState:
    cfg: ServeConfig
    supervisor: Supervisor
    sessions: Sessions
    compaction_seal: CompactionSeal
    context: ContextManager | None = None       # the context manager, made once the model is known (api.deps)
    engine_input: EngineInput | None = None     # the prompt's form for the engine, made with it
    context_lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, app: Starlette) -> AppState:
        setattr(app.state, ATTRIBUTE, self)
        return self


def app_state(conn: HTTPConnection) -> AppState:
    """The state of the app serving ``conn`` (a request)."""
    return getattr(conn.app.state, ATTRIBUTE)
