"""The served window, checked before any work and fitted after the context step.

Before: a request whose system prompt and tools alone fill the window can fit in no way (no edit
clears them): it is refused at once, before anything is logged or summarized, in the API's own
"prompt is too long" words. After the context step: a prompt that still does not fit is refused
the same way; an output limit beyond the room the prompt leaves is lowered to that room (what
Ollama and llama.cpp do), logged, and said in the ``X-Max-Tokens-Lowered`` response header.
"""

from __future__ import annotations

import logging

from agentkv.compaction.policy import room_warning
from agentkv.compaction.prompt import Message, PromptRenderer
from agentkv.server.errors import PromptTooLong

from .context import EngineForm

log = logging.getLogger(__name__)
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")   # the engine request's names (chat completions)
HEADER = "X-Max-Tokens-Lowered"
ROOM_HEADER = "X-Context-Room"


def fixed_part(renderer: PromptRenderer, conversation: list[Message], tools: list | None, window: int | None,
               engine_form: EngineForm | None, param: str) -> int:
    """The tokens of the leading system messages and tools (what no edit clears: the default
    policy's levels are set above it); a request whose fixed part fills the window is refused
    before any work."""
    if not window:
        return 0
    head = []
    for m in conversation:
        if m.get("role") not in ("system", "developer"):
            break
        head.append(engine_form(m) if engine_form else m)
    if not head and not tools:
        return 0
    fixed = renderer.count(head + [{"role": "user", "content": ""}], tools)
    if fixed >= window:
        raise PromptTooLong(fixed, window, "the system prompt and tools alone", param)
    return fixed


def room_header(window: int | None, fixed: int) -> str | None:
    """The ``X-Context-Room`` header's value where the fixed part leaves little of the window
    (logged once per distinct size)."""
    warning = room_warning(window or 0, fixed)
    if warning and (window, fixed) not in _warned:
        if len(_warned) >= 1024:
            _warned.clear()
        _warned.add((window, fixed))
        log.warning("%s", warning)
    return warning


_warned: set[tuple[int | None, int]] = set()


def fit_output(body: dict, prompt_tokens: int, window: int | None, param: str) -> str | None:
    """Refuse a prompt that fills the window; lower an output limit beyond the room it leaves.
    Returns the header value when a limit was lowered."""
    if not window:
        return None
    if prompt_tokens >= window:
        raise PromptTooLong(prompt_tokens, window, "the prompt after the context step", param)
    room = window - prompt_tokens
    lowered = None
    for key in OUTPUT_LIMITS:
        asked = body.get(key)
        if isinstance(asked, int) and asked > room:
            body[key] = room
            lowered = f"{asked} to {room} (window {window}, prompt {prompt_tokens})"
            log.info("%s %s lowered from %d to %d: the prompt is %d tokens of a %d-token window",
                     key, body.get("model"), asked, room, prompt_tokens, window)
    return lowered
