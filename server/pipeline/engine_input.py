"""The form a chat prompt reaches vLLM in: its token ids (``--engine-input tokens``, the default)
or its messages.

vLLM's chat route renders the chat template and tokenizes the whole prompt on every request
(0.3 s at 200k tokens here), work that is, but for the new turn, the previous turn's. On the tokens
path the front renders the request with vLLM's own chat preprocessing and tokenizes only what
changed since the conversation's previous prompt (``render.engine_chat``: exact by construction,
the ids are those vLLM's chat route gives the same request), and the chat request carries them in
``kv_transfer_params.prompt_token_ids``: vLLM's decode-side token reuse (vLLM 0.32,
``renderers/online_renderer.py``), which skips only templating and tokenization. The rest of
vLLM's chat layer runs as it does for messages: tool-choice checks, the tool and reasoning
parsers' ``adjust_request``, sampling defaults, tool-call and reasoning parsing streamed and not,
logprobs, finish reasons, ``n``, usage. So an answer equals the messages path's token for token.

A request goes as messages where vLLM would not use the ids or renders outside its chat
preprocessing: ``echo`` and ``return_prompt_text`` (vLLM renders those itself), non-text content
(vLLM renders media itself, and the front fetches none), a model vLLM renders with harmony or a
renderer of its own, a template that reads the clock, and a request vLLM's preprocessing refuses
(the engine answers it in its own words). Each chat request to the engine is counted by the path
it took and why (``agentkv_engine_input_requests``).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from agentkv.compaction.prompt import Message
from agentkv.server.metrics import ENGINE_INPUT
from agentkv.server.options import EngineInputMode
from agentkv.server.render.engine_chat import EngineChat, NotRendered

from .engine_call import Make

log = logging.getLogger(__name__)

# vLLM chat fields with which it renders the messages itself (the token reuse path skips them)
RENDER_FIELDS = ("echo", "return_prompt_text")


def has_media(messages: list[Message]) -> bool:
    """Content that is not text (vLLM renders media itself)."""
    return any(isinstance(p, dict) and p.get("type", "text") != "text"
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def why_messages(body: dict[str, Any]) -> str | None:
    """Why this engine request must go as messages, known from the request alone."""
    for f in RENDER_FIELDS:
        if body.get(f) not in (None, False):
            return f"field:{f}"
    if has_media(body["messages"]):
        return "non_text_content"
    return None


class EngineInput:
    """The server's engine-input setting and the front's render of the engine's prompts
    (``chat``: None where it could not be built, every prompt then goes as messages)."""

    def __init__(self, mode: EngineInputMode, chat: EngineChat | None):
        self.mode, self.chat = mode, chat
        why = "the front could not build vLLM's renderer" if chat is None else chat.unrendered
        self.unrendered = why
        if why and mode == "tokens":
            log.warning("%s: every prompt goes to vLLM as messages", why)

    def for_turn(self, body: dict[str, Any], asked: EngineInputMode | None, slot: Hashable) -> Make:
        """How each engine request of a turn is made from its chat body: the ids added (tokens
        path), or the body as it is. ``asked``: the request's own ``engine_input``; ``slot``: the
        conversation branch (owner-scoped) whose previous prompt the tokenization reuses."""
        reason: str | None
        if self.mode == "messages":
            reason = "server"
        elif asked == "messages":
            reason = "request"
        elif self.unrendered:
            reason = "renderer"
        else:
            reason = why_messages(body)
        return InputPath(reason, self.chat, slot).request


@dataclass
class InputPath:
    """One turn's engine input: ``request(body)`` is the chat request sent for ``body`` (each
    server-tool round renders its own longer prompt)."""

    reason: str | None     # why the turn goes as messages (None: it goes as tokens)
    chat: EngineChat | None
    slot: Hashable

    async def request(self, body: dict) -> dict:
        reason = self.reason
        if reason is None:
            assert self.chat is not None   # without the front's render, for_turn gave a reason ("renderer")
            try:
                ids = await self.chat.prompt_ids(body, self.slot)
            except NotRendered as exc:
                log.debug("sent as messages (%s): %s", exc.reason, exc)
                reason = exc.reason
        ENGINE_INPUT.labels("messages" if reason else "tokens", reason or "").inc()
        if reason:
            return body
        kv = {**(body.get("kv_transfer_params") or {}), "prompt_token_ids": ids}
        return {**body, "kv_transfer_params": kv}
