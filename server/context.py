"""Applies a context policy to a session's conversation: the request path's compaction step.

Order per request: sync the conversation into the session log (before any edit), rebuild the view
from the edits in force, run the policy's edits on the view, persist what fired, report it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..compaction.clearing import clear_tool_uses
from ..compaction.config import ClearToolUses
from ..compaction.policy import ContextManagement, default_policy
from ..compaction.prompt import Message, PromptRenderer
from ..compaction.summarize import ModelClient, summarize
from .sessions import SessionRef, Sessions

log = logging.getLogger("agentkv.context")


@dataclass
class Prepared:
    key: str                # the session's storage key (owner/id)
    session_id: str         # its public id (X-Session-Id)
    messages: list[Message]
    report: dict[str, Any]
    edits: list  # PromptEdit of clearing in this request, against the pre-clearing view prompt
    old_ids: list[int]      # the pre-clearing view prompt (when clearing edited it)


class ContextManager:
    def __init__(self, sessions: Sessions, renderer: PromptRenderer, summarizer: ModelClient):
        self.sessions, self.renderer, self.summarizer = sessions, renderer, summarizer

    def prepare(self, owner: str, ref: SessionRef, messages: list[Message], tools: list | None,
                policy: ContextManagement | None, window: int | None = None) -> Prepared:
        synced = self.sessions.sync(owner, ref, messages)
        key, session_id, state = synced.key, synced.id, synced.state
        view, where = state.view(messages)
        before = self.renderer.count(messages, tools)
        applied: list[dict] = []
        failed: list[dict] = []
        kv_edits: list = []
        old_ids: list[int] = []
        for edit in policy.edits if policy else []:
            if isinstance(edit, ClearToolUses):
                r = clear_tool_uses(view, self.renderer, edit, tools)
                if not r.edits:
                    continue
                for i in {e.message_index for e in r.edits}:
                    state.replaced[where[i]] = r.messages[i]
                kv_edits, old_ids = r.edits, r.old_ids
                view = r.messages
                applied.append({"type": "clear_tool_uses", "cleared_tool_uses": r.cleared_tool_uses,
                                "cleared_input_tokens": r.cleared_tokens,
                                "edits": [e.as_dict() for e in r.edits]})
            else:
                notes = [f"{kind}: {text}" for kind, text in self.sessions.log.notes(key)]
                try:
                    r = summarize(view, self.renderer, edit, self.summarizer, tools, notes, history=messages,
                                  window=window)
                except Exception as exc:  # the summarizer's call failed: serve the request uncompacted
                    log.warning("session %s: summary failed: %s", session_id, exc)
                    failed.append({"type": "compact", "error": f"{exc.__class__.__name__}: {exc}"[:500]})
                    continue
                if not r.summarized_messages:
                    continue
                head = next(i for i, m in enumerate(r.messages) if m is not view[i])
                cut = len(view) - (len(r.messages) - head - 1)
                state.summary, state.summary_start = r.messages[head], where[head]
                state.summary_end = where[cut] if cut < len(where) else len(messages)
                where = where[:head + 1] + where[cut:]
                view = r.messages
                kv_edits, old_ids = [], []  # a summary rewrites the prompt from `head` on
                applied.append({"type": "compact", "summarized_messages": r.summarized_messages,
                                "summary_tokens": r.summary_tokens})
        self.sessions.save(key, state)
        after = self.renderer.count(view, tools) if applied or state.replaced or state.summary else before
        report = {"session_id": session_id, "applied_edits": applied,
                  "prompt_tokens_before": before, "prompt_tokens_after": after}
        if failed:
            report["failed_edits"] = failed
        return Prepared(key, session_id, view, report, kv_edits, old_ids)


async def manage(ctx: ContextManager, cfg, window: int, owner: str, ref: SessionRef,
                 conversation: list[Message], tools: list | None, requested: ContextManagement | None) -> Prepared:
    """The request path's compaction step for any API: the session, the policy (the request's, else
    the server default when enabled), then ``prepare`` off the event loop."""
    import asyncio

    policy = requested
    if policy is None and cfg.context_management:
        policy = default_policy(window, cfg.clear_at, cfg.compact_at)
    return await asyncio.to_thread(ctx.prepare, owner, ref, conversation, tools, policy, window or None)
