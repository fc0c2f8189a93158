"""The registry of ``context_management`` edit kinds: each kind is one class that carries its
config, its wire names and what it does; the request models, the policy and the context step know
the kinds only through this registry.

To add an edit kind: write ``compaction/edit_kinds/<kind>.py`` with one subclass of
``base.EditKind``: a ``type: Literal["<short name>", "<Anthropic's dated name>"] = "<short name>"``
field (its wire names, the default first) and the other config fields with their validators (the
edge checks them: a bad value is an HTTP 400 naming the field); ``apply(view, step)``, returning
``base.Applied`` (the new view, its ``applied_edits`` entry, and what the step records: messages
replaced in place, a summary span, prompt edits for the KV connector), ``base.Failed`` or None;
and, where they apply, ``must_be_first``, ``kv_report`` and ``defers_clearing``. Then import it
below and add it to the ``register`` calls. Nothing else changes: the request models
(``compaction.policy.ContextManagement``) take the union of the registered kinds, which
``edit_union`` builds once, when ``compaction.policy`` is first imported, so a kind registers
before that (registering later is an error, never a silent no-op).
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from .base import Applied, EditKind, EditStep, Failed
from .clear_thinking import ClearThinking
from .clear_tool_uses import ClearToolUses
from .compact import Compact

__all__ = ["Applied", "ClearThinking", "ClearToolUses", "Compact", "EditKind", "EditStep", "Failed",
           "edit_union", "kinds", "named", "register"]

_KINDS: list[type[EditKind]] = []
_BY_NAME: dict[str, type[EditKind]] = {}
_sealed = False


def register(kind: type[EditKind]) -> type[EditKind]:
    """Add an edit kind (usable as a class decorator); its wire names must be new."""
    if _sealed:
        raise RuntimeError(f"edit kind {kind.__name__} registered after the request models were built: "
                           "register it before agentkv.compaction.policy is imported")
    if not kind.NAMES:
        raise TypeError(f"edit kind {kind.__name__} has no type: Literal[...] field")
    taken = [n for n in kind.NAMES if n in _BY_NAME]
    if taken:
        raise ValueError(f"edit kind {kind.__name__}: {taken} already registered")
    _KINDS.append(kind)
    _BY_NAME.update(dict.fromkeys(kind.NAMES, kind))
    return kind


def kinds() -> tuple[type[EditKind], ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS)


def named(name: str) -> type[EditKind] | None:
    """The kind a wire name (short or Anthropic's) belongs to."""
    return _BY_NAME.get(name)


def edit_union():
    """The type of one entry of ``edits``: the registered kinds told apart by ``type``. Closes
    the registry (the request models are built from it)."""
    global _sealed
    _sealed = True
    return Annotated[Union[tuple(_KINDS)], Field(discriminator="type")]  # noqa: UP007 (a runtime tuple)


register(ClearToolUses)
register(ClearThinking)
register(Compact)
