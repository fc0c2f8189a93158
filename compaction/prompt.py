"""The exact prompt the engine sees, with each message's token range; token counting per message.

Rendering uses the served model's tokenizer and chat template (transformers). A message's range is
found by rendering prefixes: message ``i`` spans from the end of ``render(messages[:i])`` to the end
of ``render(messages[:i+1])``, which holds for templates that render messages in order (ChatML and
the like). Counting is incremental: each message's segment is tokenized once and cached.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

Message = dict[str, Any]


def content_text(content) -> str:
    """A message's text: the string itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def as_engine_sees(messages: list[Message]) -> list[Message]:
    """Messages as vLLM hands them to the chat template: tool-call arguments parsed from JSON
    strings into objects (invalid or non-object JSON becomes ``{}``), an assistant's ``reasoning``
    also given as ``reasoning_content``, so our render matches the engine's token for token."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("reasoning") is not None:
            m = {**m, "reasoning_content": m["reasoning"]}
        if not m.get("tool_calls"):
            out.append(m)
            continue
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = {}
            fn["arguments"] = args if isinstance(args, dict) else {}
            calls.append({**c, "function": fn})
        out.append({**m, "tool_calls": calls})
    return out


def message_key(message: Message) -> str:
    return hashlib.sha256(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class RenderedPrompt:
    """``token_ids`` of the full prompt; ``ranges[i]`` = token ``[start, end)`` of message i.
    Tokens before ``ranges[0]`` are the header (e.g. tool signatures); after the last, the
    generation prompt."""

    text: str
    token_ids: list[int]
    ranges: list[tuple[int, int]]

    def segment(self, i: int) -> list[int]:
        a, b = self.ranges[i]
        return self.token_ids[a:b]


class PromptRenderer:
    """Renders and counts with one tokenizer (``transformers.PreTrainedTokenizerBase``)."""

    def __init__(self, tokenizer, cache_size: int = 65536):
        self.tokenizer = tokenizer
        self.count_text = lru_cache(maxsize=cache_size)(self._tokens_in)
        self._bounds: dict[str, int] = {}

    @classmethod
    def from_pretrained(cls, path: str) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render_text(self, messages: list[Message], tools: list | None, generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(as_engine_sees(messages), tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _tokens_in(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def char_bounds(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """Character offset where each message's rendering ends. Cached along the conversation
        (key: hash of tools and all messages up to that one), so a growing session renders only
        the prefixes it has not seen."""
        h = hashlib.sha256(json.dumps(tools or [], sort_keys=True, default=str).encode()).hexdigest()
        out = []
        for i, m in enumerate(messages):
            h = hashlib.sha256((h + message_key(m)).encode()).hexdigest()
            if h not in self._bounds:
                if len(self._bounds) > 65536:
                    self._bounds.clear()
                self._bounds[h] = len(self.render_text(messages[: i + 1], tools, False))
            out.append(self._bounds[h])
        return out

    def render(self, messages: list[Message], tools: list | None = None) -> RenderedPrompt:
        """Tokenize the whole prompt; message 0's range also holds the header (tool signatures)."""
        text = self.render_text(messages, tools, True)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        ranges, t = [], 0
        for b in self.char_bounds(messages, tools):
            s = t
            while t < len(ids) and offsets[t][0] < b:
                t += 1
            ranges.append((s, t))
        return RenderedPrompt(text, ids, ranges)

    def count(self, messages: list[Message], tools: list | None = None) -> int:
        """Prompt tokens, from cached per-message segments (equal to ``len(render().token_ids)``
        for templates whose message boundaries fall on special tokens)."""
        if not messages:
            return 0
        bounds = [0] + self.char_bounds(messages, tools)
        full = self.render_text(messages, tools, True)
        pieces = [full[a:b] for a, b in zip(bounds, bounds[1:])] + [full[bounds[-1]:]]
        return sum(self.count_text(p) for p in pieces if p)
