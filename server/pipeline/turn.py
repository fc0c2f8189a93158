"""The turn every API runs, written once: each route converts its request to chat terms
(``TurnInput``), calls ``prepare_turn`` once, and encodes what ``Turn.complete`` or ``Turn.stream``
gives back in its own shape.

In request order: the server-executed tools join the client's (before the context step, so
triggers and token counts see what the engine gets); a system prompt and tools that fill the
window are refused before any work (``window``); the session is found and the conversation logged
before any edit, and the context policy runs (``context.manage``); the output limit is fitted to
the room left; the prompt's form is chosen (``engine_input``: the front's token ids, or the messages
for vLLM to render); then, at the first engine call, KV reuse tells the connector which edit
happened (``kv.reuse.attach``), and the engine answers with server-tool rounds resolved
(``engine_call``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from agentkv.compaction.policy import ContextManagement
from agentkv.compaction.prompt import Message
from agentkv.server.config import ServeConfig
from agentkv.server.engine.client import EngineClient
from agentkv.server.kv import reuse as kv_reuse
from agentkv.server.kv_modes import kv_mode
from agentkv.server.options import AgentKVFields

from . import cache_salt, server_tools, window
from .context import ContextManager, EngineForm, Prepared, manage
from .engine_call import Completion, EngineStream, Make, Refusal, completion, open_stream
from .server_tools import ToolRunner
from .sessions import SessionRef, session_ref
from .state import AppState


@dataclass
class TurnInput:
    """A request in chat terms, as an API hands it to the pipeline."""

    conversation: list[Message]        # as the session log keeps it
    tools: list[dict] | None           # the client's tools, chat form
    body: dict[str, Any]               # the engine's chat request, less messages and tools
    fields: AgentKVFields              # agentkv's own fields of the request
    session: SessionRef                # the session it names (``sessions.session_ref``)
    policy: ContextManagement | None   # the request's edits (the server default joins in ``manage``)
    engine_form: EngineForm | None = None   # a logged message as the engine takes it (Anthropic's blocks)
    param: str = "messages"            # the request field that holds the conversation (errors name it)


class KVArgs(NamedTuple):
    """What attaching KV reuse takes besides the turn (``kv.reuse.attach``)."""

    cfg: ServeConfig
    fields: AgentKVFields
    model_path: str | None
    owner: str


@dataclass
class Turn:
    """A prepared turn: the managed view and its report, and the engine request ready to send."""

    prepared: Prepared
    body: dict[str, Any]
    runner: ToolRunner | None
    engine: EngineClient
    _kv: KVArgs | None   # until KV reuse has been attached
    make: Make          # each engine request made of its chat body (``engine_input``)
    lowered: str | None = None   # the output limit, lowered to the room the prompt leaves
    room: str | None = None      # the system prompt and tools leave little of the window to manage

    @property
    def session_id(self) -> str:
        return self.prepared.session_id

    @property
    def report(self) -> dict:
        return self.prepared.report

    def headers(self) -> dict[str, str]:
        out = {"X-Session-Id": self.prepared.session_id}
        if self.lowered:
            out[window.HEADER] = self.lowered
        if self.room:
            out[window.ROOM_HEADER] = self.room
        return out

    def extra(self, server_tool_calls: list[dict]) -> dict[str, Any]:
        """agentkv's additions to a response: the context-management report and server tool calls."""
        out: dict[str, Any] = {"context_management": self.prepared.report}
        if server_tool_calls:
            out["server_tool_calls"] = server_tool_calls
        return out

    async def _attach(self) -> None:
        """The cache salt and KV reuse, at the first engine call only (a turn answered without the
        engine, such as a paused compaction, primes nothing)."""
        if self._kv is None:
            return
        cfg, fields, model_path, owner = self._kv
        self._kv = None
        salts = kv_reuse.Salts(cache_salt.exact(owner, fields.cache_salt, cfg.shared_prefix_cache),
                               cache_salt.approximate(self.prepared.branch, fields.cache_salt))
        await kv_reuse.attach(cfg, self.engine, self.body, self.prepared, fields.kv_reuse, fields.kv_blend,
                              model_path, salts)

    async def complete(self) -> Completion | Refusal:
        await self._attach()
        return await completion(self.engine, self.body, self.runner, self.prepared.report, self.make)

    async def stream(self) -> EngineStream | Refusal:
        await self._attach()
        return await open_stream(self.engine, self.body, self.runner, self.make)


def session_of(headers: Mapping[str, str], fields: AgentKVFields, body: Mapping[str, Any]) -> SessionRef:
    """The session a request names by the documented precedence (``sessions.SOURCES``)."""
    return session_ref(headers, {**body, "session_id": fields.session_id})


async def prepare_turn(state: AppState, engine: EngineClient, ctx: ContextManager, owner: str,
                       turn: TurnInput) -> Turn:
    """Everything before the engine call, the same for every API. ``state``: the app's state
    (config, supervisor); ``ctx``: the context manager; ``owner``: the caller's key digest."""
    cfg = state.cfg
    sup = state.supervisor
    on = turn.fields.server_tools if turn.fields.server_tools is not None else cfg.server_tools
    tools = server_tools.with_server_tools(turn.tools) if on else turn.tools   # reserved names: 400 before logging
    fixed = window.fixed_part(ctx.renderer_for(owner), turn.conversation, tools, sup.max_model_len,
                              turn.engine_form, turn.param)
    mode = kv_mode(turn.fields.kv_reuse or cfg.kv_reuse)
    prepared = await manage(ctx, cfg, sup.max_model_len, owner, turn.session, turn.conversation, tools,
                            turn.policy, fixed=fixed, engine_form=turn.engine_form, shifting=mode.moves(cfg),
                            salt=cache_salt.exact(owner, None, cfg.shared_prefix_cache))
    body = {**turn.body, "messages": prepared.messages}
    if tools:
        body["tools"] = tools
    lowered = window.fit_output(body, prepared.report["prompt_tokens_after"], sup.max_model_len, turn.param)
    runner = ToolRunner(ctx.sessions.log, prepared.key, cfg.max_server_tool_rounds, lowered is not None) if on else None
    assert state.engine_input is not None   # made with the context manager (api.deps)
    make = state.engine_input.for_turn(body, turn.fields.engine_input, prepared.branch)
    room = window.room_header(sup.max_model_len, fixed) if cfg.context_management else None
    return Turn(prepared, body, runner, engine, KVArgs(cfg, turn.fields, sup.model_path, owner), make, lowered, room)
