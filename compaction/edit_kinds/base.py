"""What an edit kind is, what the context step hands each edit (``EditStep``) and what an edit
hands back (``Applied``, ``Failed`` or None: it did nothing).

An edit sees the view (the messages the engine would get) and returns the view after it, with its
entry in the response's ``applied_edits`` and what the step must record: which messages it replaced
in place, which run of them became one summary message, which prompt edits the KV connector may
move. The step records these the same way for every kind (``server.pipeline.context``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict

from agentkv.compaction.edits import PromptEdit
from agentkv.compaction.prompt import Message, PromptRenderer

if TYPE_CHECKING:
    from agentkv.compaction.summarize import ModelClient


@dataclass
class EditStep:
    """What one pass of the context step gives every edit of the policy."""

    renderer: PromptRenderer
    tools: list | None
    edits: list[EditKind]                # the policy's edits, in order (an edit may ask the others)
    window: int | None                   # the model's context window
    history: list[Message]               # the whole conversation, as the engine takes it
    session: str | None = None           # the session's storage key (None: outside any session)
    notes: Callable[[], list[str]] | None = None   # the session's notes, read when asked
    summarizer: ModelClient | None = None          # None: no summary is written in this pass


@dataclass
class Applied:
    """What an edit did to the view."""

    messages: list[Message]              # the view after the edit
    report: dict[str, Any]               # its entry in ``applied_edits`` (``type``: the name it was given)
    replaced: Iterable[int] = ()         # positions of the view whose message it replaced (same length)
    summary: tuple[int, int] | None = None   # (head, cut): the view's [head, cut) became messages[head]
    kv_edits: list[PromptEdit] | None = None  # the prompt edits the KV connector may move (None: as before)
    old_ids: list[int] = field(default_factory=list)   # the prompt ``kv_edits`` are positions of
    moves_tokens: bool = False           # it changed tokens: a later edit's ``kv_edits`` no longer apply


@dataclass
class Failed:
    """An edit that could not be made: the request is served without it."""

    report: dict[str, Any]               # its entry in ``failed_edits`` (``type``, ``error``)


class EditKind(BaseModel):
    """One kind of ``context_management`` edit: its config (the pydantic fields, checked at the
    edge: a bad value is a 400 naming the field) and what it does. Its wire names are the values
    of its ``type`` field (``Literal``), the default first: ``NAMES``, ``NAME``."""

    model_config = ConfigDict(extra="forbid")

    NAMES: ClassVar[tuple[str, ...]] = ()
    NAME: ClassVar[str] = ""
    must_be_first: ClassVar[bool] = False   # the policy refuses it anywhere but first
    kv_report: ClassVar[bool] = False       # its ``applied_edits`` entry carries what the KV connector did

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields.get("type")
        if kind is not None:
            cls.NAMES, cls.NAME = get_args(kind.annotation), kind.default

    def apply(self, view: list[Message], step: EditStep) -> Applied | Failed | None:
        """The edit on ``view`` (None: nothing to do)."""
        raise NotImplementedError

    def defers_clearing(self, tokens: int, window: int | None) -> bool:
        """Whether a clearing batch that cannot bring a ``tokens``-token prompt under its own
        trigger waits for this edit instead (a summary, which reduces what clearing cannot)."""
        return False

    @property
    def compaction_block(self) -> bool:
        """Whether the summary this edit writes leads the answer as a ``compaction`` block."""
        return False
