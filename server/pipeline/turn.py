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

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from agentkv.compaction.policy import ContextManagement
from agentkv.compaction.prompt import Message, content_text
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

log = logging.getLogger(__name__)


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
    api: str = "chat"                  # which API it came through: chat, messages, responses (its record says)


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
    record: TurnRecord | None = None   # where the turn's record goes once the engine answered it

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
        out = await completion(self.engine, self.body, self.runner, self.prepared.report, self.make)
        if isinstance(out, Completion):
            await self._recorded(out.payload.get("usage"))
        return out

    async def stream(self) -> EngineStream | Refusal:
        await self._attach()
        return await open_stream(self.engine, self.body, self.runner, self.make, on_end=self._recorded)

    async def _recorded(self, usage: dict | None) -> None:
        """Keep what the turn did in the session log (the sessions page shows it), in the background:
        the answer's end never waits on the log's write, and the write never fails the turn."""
        if self.record is None:
            return
        task = asyncio.create_task(self._write(self.record, usage))
        _WRITING.add(task)               # the loop keeps weak references only
        task.add_done_callback(_WRITING.discard)

    async def _write(self, record: TurnRecord, usage: dict | None) -> None:
        try:
            await asyncio.to_thread(record.write, self.prepared, usage)
        except Exception:  # noqa: BLE001 - a record that cannot be written loses only the page's row
            log.warning("session %s: the turn's record was not written", self.prepared.session_id, exc_info=True)


_WRITING: set[asyncio.Task] = set()   # turn records being written


@dataclass
class TurnRecord:
    """What one engine turn did, for the session log's ``turns`` (``SessionLog.add_turn``): the
    window, the prompt before and after the context step, the engine's usage (tokens computed and
    cached), and every edit's report (cleared tool uses, the summary, what KV reuse did)."""

    log: Any        # the session log
    api: str
    window: int
    mode: str       # the KV reuse mode it ran in
    messages: int   # messages of the conversation the client sent

    def write(self, prepared: Prepared, usage: dict | None) -> None:
        usage = usage or {}
        prompt = usage.get("prompt_tokens") or 0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        report = prepared.report
        self.log.add_turn(prepared.key, prepared.branch, {
            "session_id": prepared.session_id, "api": self.api, "window": self.window, "kv_mode": self.mode,
            "messages": self.messages, "prompt_tokens_before": report["prompt_tokens_before"],
            "prompt_tokens_after": report["prompt_tokens_after"], "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": max(0, prompt - cached), "completion_tokens": usage.get("completion_tokens") or 0,
            "applied_edits": report["applied_edits"], "failed_edits": report.get("failed_edits", []),
            "summary": _text(prepared.compaction) if prepared.compaction is not None else None})


def _text(message: Message) -> str:
    """A summary message's text: its string, or its parts' (a compaction block's ``content`` too)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("content") or p.get("text") or "") for p in content if isinstance(p, dict))
    return content_text(content)


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
    record = TurnRecord(ctx.sessions.log, turn.api, sup.max_model_len, mode.name, len(turn.conversation))
    return Turn(prepared, body, runner, engine, KVArgs(cfg, turn.fields, sup.model_path, owner), make, lowered, room,
                record)
