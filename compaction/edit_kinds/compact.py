"""``compact`` (Anthropic's ``compact_20260112``): the oldest part of the conversation becomes one
summary message (``compaction.summarize``)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agentkv.compaction.edits import span_edit
from agentkv.compaction.prompt import Message
from agentkv.compaction.summarize import SummaryPending, summarize

from .base import Applied, EditKind, EditStep, Failed
from .fields import amount

COMPACT_MIN_TRIGGER = 50_000  # Anthropic's minimum for compact_20260112

log = logging.getLogger(__name__)


class Compact(EditKind):
    """Summarize the oldest part of the conversation once the prompt reaches ``trigger`` tokens.

    ``compact_20260112`` (Anthropic's): everything before the point of compaction is summarized
    (``keep_recent_tokens`` defaults to 0), ``trigger`` is at least 50,000; the response carries a
    ``compaction`` block, and with ``pause_after_compaction`` it stops there (no generation)."""

    kv_report = True   # the summary is one span of the prompt: with shift, the kept tail's K/V move
    type: Literal["compact", "compact_20260112"] = "compact"
    trigger: int = Field(150_000, ge=0, description="input tokens at which summarization runs")
    pause_after_compaction: bool = Field(False, description="answer with the compaction alone")
    instructions: str | None = Field(None, description="replaces the default summary prompt")
    keep_recent_tokens: int = Field(20_000, ge=0, description="newest tokens kept word for word")
    user_messages_tokens: int = Field(8_000, ge=0, description="budget of user messages copied verbatim")
    summary_max_tokens: int = Field(1024, ge=16, description="length limit of the handoff note")
    always: bool = Field(False, description="summarize even where the summary is not shorter than what it "
                                            "replaces (compaction asked for outright)")

    @field_validator("trigger", mode="before")
    @classmethod
    def _trigger(cls, v: Any) -> Any:
        return 150_000 if v is None else amount(v, "input_tokens")

    @model_validator(mode="before")
    @classmethod
    def _official_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "compact_20260112":
            data = {"keep_recent_tokens": 0, **data}
        return data

    @model_validator(mode="after")
    def _official_minimum(self) -> Compact:
        if self.type == "compact_20260112" and self.trigger < COMPACT_MIN_TRIGGER:
            raise ValueError(f"compact_20260112: trigger must be at least {COMPACT_MIN_TRIGGER} input tokens "
                             "(use agentkv's 'compact' for a lower one)")
        return self

    @property
    def compaction_block(self) -> bool:
        return self.type == "compact_20260112"

    def defers_clearing(self, tokens: int, window: int | None) -> bool:
        """A clearing batch waits while the prompt is under this trigger (and the window), so
        nothing overflows; at the trigger it is made first (less to summarize, and the prompt still
        shrinks if the summary fails)."""
        return tokens < min(self.trigger, window or self.trigger)

    def apply(self, view: list[Message], step: EditStep) -> Applied | Failed | None:
        """Runs only with a session to write to and a summarizer (``SummaryPending`` from it goes
        up); a summarizer that fails is a failed edit, and the request is served uncompacted."""
        if step.session is None or step.summarizer is None:
            return None
        if step.renderer.count(view, step.tools) < self.trigger:  # no summary: the log's notes not read
            return None
        notes = step.notes() if step.notes is not None else []
        try:
            r = summarize(view, step.renderer, self, step.summarizer, step.tools, notes, history=step.history,
                          window=step.window)
        except SummaryPending:
            raise
        except Exception as exc:  # the summarizer's call failed: serve the request uncompacted
            log.warning("session %s: summary failed: %s", step.session, exc)
            return Failed({"type": self.type, "error": f"{exc.__class__.__name__}: {exc}"[:500]})
        if not r.summarized_messages:
            return None
        head = next(i for i, m in enumerate(r.messages) if m is not view[i])
        cut = len(view) - (len(r.messages) - head - 1)
        # the summarized messages -> the summary: one span, so the kept tail's K/V can move (shift)
        old_ids = step.renderer.render(view, step.tools).token_ids
        kv_edits = span_edit(old_ids, step.renderer.render(r.messages, step.tools).token_ids, head, "summary")
        return Applied(r.messages, {"type": self.type, "summarized_messages": r.summarized_messages,
                                    "summary_tokens": r.summary_tokens,
                                    "cleared_input_tokens": r.tokens_before - r.tokens_after},
                       summary=(head, cut), kv_edits=kv_edits, old_ids=old_ids)
