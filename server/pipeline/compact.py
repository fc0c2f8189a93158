"""Compaction on demand: the whole conversation (after its system messages) summarized into one
message, for the requests that ask for it outright rather than by a threshold (the Responses API's
``/v1/responses/compact`` and trailing ``compaction_trigger``, Anthropic's ``compaction``)."""

from __future__ import annotations

from agentkv.compaction.edit_kinds import Compact
from agentkv.compaction.policy import ContextManagement, summary_limit
from agentkv.compaction.prompt import Message
from agentkv.compaction.summarize import is_summary
from agentkv.server.errors import APIError

from . import cache_salt
from .context import ContextManager, EngineForm, Prepared, manage
from .sessions import SessionRef
from .state import AppState
from .window import fixed_part


def explicit_policy(window: int, instructions: str | None = None) -> ContextManagement:
    """Everything after the system messages becomes the summary (the user's messages copied into it);
    ``instructions`` replace the summary prompt."""
    return ContextManagement(edits=[Compact(trigger=0, keep_recent_tokens=0, user_messages_tokens=window // 20,
                                            summary_max_tokens=summary_limit(window),
                                            instructions=instructions, always=True)])


def summary_of(prepared: Prepared) -> Message | None:
    """The summary the conversation now stands on: the one written in this request, else the one its
    view already held (the same conversation compacted again, with nothing new since)."""
    if prepared.compaction is not None:
        return prepared.compaction
    rest = [m for m in prepared.messages if m.get("role") not in ("system", "developer")]
    return rest[0] if len(rest) == 1 and is_summary(rest[0]) else None


def fired(prepared: Prepared) -> dict | None:
    """The report of the summary agentkv's own ``compact`` wrote in this request, if one did."""
    return next((e for e in prepared.report["applied_edits"] if e["type"] == Compact.NAME), None)


async def compact_now(state: AppState, ctx: ContextManager, owner: str, ref: SessionRef, conversation: list[Message],
                      tools: list | None, instructions: str | None = None, engine_form: EngineForm | None = None,
                      param: str = "messages") -> Prepared:
    """The conversation, logged, with its summary written; a summary that could not be written
    is a 503 (``compaction_failed``): the client asked for it and gets no silent no-op. A system
    prompt and tools that fill the window alone are refused first (no summary can make them fit)."""
    window = state.supervisor.max_model_len
    fixed_part(ctx.renderer_for(owner), conversation, tools, window, engine_form, param)
    prepared = await manage(ctx, state.cfg, window, owner, ref, conversation, tools,
                            explicit_policy(window, instructions), engine_form=engine_form,
                            salt=cache_salt.exact(owner, None, state.cfg.shared_prefix_cache))
    if prepared.report.get("failed_edits"):
        raise APIError(503, f"the summary could not be written: {prepared.report['failed_edits'][0]['error']}",
                       code="compaction_failed")
    return prepared
