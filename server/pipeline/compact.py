"""Compaction on demand: the whole conversation (after its system messages) summarized into one
message, for the requests that ask for it outright rather than by a threshold (the Responses API's
``/v1/responses/compact`` and trailing ``compaction_trigger``)."""

from __future__ import annotations

from ...compaction.config import Compact
from ...compaction.policy import ContextManagement
from ...compaction.prompt import Message
from ..errors import APIError
from .context import Prepared, manage
from .sessions import SessionRef


def explicit_policy(window: int) -> ContextManagement:
    """Everything after the system messages becomes the summary (the user's messages copied into it)."""
    return ContextManagement(edits=[Compact(trigger=0, keep_recent_tokens=0, user_messages_tokens=window // 20,
                                            summary_max_tokens=max(16, min(1024, window // 8)))])


def fired(prepared: Prepared) -> dict | None:
    """The report of the summary written in this request, if one was."""
    return next((e for e in prepared.report["applied_edits"] if e["type"] == "compact"), None)


async def compact_now(state, ctx, owner: str, ref: SessionRef, conversation: list[Message],
                      tools: list | None) -> Prepared:
    """The conversation, logged, with its summary written; a summary that could not be written
    is a 503 (``compaction_failed``): the client asked for it and gets no silent no-op."""
    window = state.supervisor.max_model_len
    prepared = await manage(ctx, state.cfg, window, owner, ref, conversation, tools, explicit_policy(window))
    if prepared.report.get("failed_edits"):
        raise APIError(503, f"the summary could not be written: {prepared.report['failed_edits'][0]['error']}",
                       code="compaction_failed")
    return prepared
