"""The served window, checked before any work and fitted after the context step.

Before: a request whose system prompt and tools alone fill the window can fit in no way (no edit
clears them): it is refused at once, before anything is logged or summarized, in the API's own
"prompt is too long" words. After the context step: a prompt that still does not fit is refused
the same way; an output limit beyond the room the prompt leaves is lowered to that room (what
Ollama and llama.cpp do), logged, and said in the ``X-Max-Tokens-Lowered`` response header.
"""

from __future__ import annotations

import logging

from ...compaction.prompt import Message
from ..errors import PromptTooLong
from .context import EngineForm

log = logging.getLogger("agentkv.window")
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")   # the engine request's names (chat completions)
HEADER = "X-Max-Tokens-Lowered"


def check_fixed_part(renderer, conversation: list[Message], tools: list | None, window: int | None,
                     engine_form: EngineForm | None, param: str) -> None:
    """Refuse, before any work, a request whose leading system messages and tools fill the window."""
    if not window:
        return
    head = []
    for m in conversation:
        if m.get("role") not in ("system", "developer"):
            break
        head.append(engine_form(m) if engine_form else m)
    if not head and not tools:
        return
    fixed = renderer.count(head + [{"role": "user", "content": ""}], tools)
    if fixed >= window:
        raise PromptTooLong(fixed, window, "the system prompt and tools alone", param)


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
