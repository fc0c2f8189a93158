"""The exact prompt the engine sees, with each message's token range; token counting per message.

Rendering uses the served model's tokenizer and a render of the conversation's text: in the server
vLLM's own (message normalization, tool dumping, chat template: ``server.render.engine_chat``),
in library use transformers' ``apply_chat_template``. A message's range is
found by rendering prefixes: message ``i`` spans from the end of ``render(messages[:i])`` to the end
of ``render(messages[:i+1])``, which holds for templates that render messages in order (ChatML and
the like). Counting is incremental: each message's segment is tokenized once and cached.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from .prompt_segments import (
    Boundaries,
    Layout,
    NotLocal,
    RenderText,
    Segment,
    SegmentCache,
    TemplateCheck,
    check_template,
    context,
    generation_text,
    memo,
    segment_text,
)
from .token_cache import Splits, TokenCache

Message = dict[str, Any]
log = logging.getLogger(__name__)


def content_text(content) -> str:
    """A message's text: the string itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def template_text(template) -> str | None:
    """A tokenizer's chat template as one text (named templates, a dict, joined)."""
    return "\n".join(template.values()) if isinstance(template, dict) else template


_ENCODE = msgspec.json.Encoder(enc_hook=str)


def message_key(message: Any) -> str:
    """A digest of a message (or any JSON value) exact to the byte: keys in their order, ``10``,
    ``10.0`` and ``true`` all different (Python's ``==`` takes them as equal, a template does not)."""
    return hashlib.sha256(_ENCODE.encode(message)).hexdigest()


_MEMO: contextvars.ContextVar[dict[int, tuple[Message, str]] | None] = contextvars.ContextVar(
    "agentkv_message_keys", default=None)


@contextlib.contextmanager
def one_step() -> Iterator[None]:
    """Within this block a message object's key is computed once (``KnownMessages.keys``): for one
    request's context step, which asks for the keys of the same messages several times and changes
    none of them in place."""
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


class KnownMessages:
    """``message_key`` of each message of a list; inside ``one_step`` each message object's key is
    computed once."""

    def keys(self, messages: list[Message]) -> list[str]:
        memo = _MEMO.get()
        if memo is None:
            return [message_key(m) for m in messages]
        out = []
        for m in messages:
            seen = memo.get(id(m))
            if seen is None or seen[0] is not m:
                seen = memo[id(m)] = (m, message_key(m))   # the object is held: its id is not reused
            out.append(seen[1])
        return out


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


def transformers_render(tokenizer) -> RenderText:
    """The tokenizer's chat template applied by transformers to the messages as given (the library's
    default; the server renders with vLLM's own normalization, ``server.render.engine_chat``)."""
    def render(messages: list[Message], tools: list | None, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return render


class PromptRenderer:
    """Renders and counts with one tokenizer (``transformers.PreTrainedTokenizerBase``) and one
    render of a conversation's text (``render_text(messages, tools, generation_prompt)``: the
    engine's, where there is one; else ``transformers_render``).

    Where the chat template allows (``prompt_segments.check_template``), a conversation's prompt is
    kept as one cached segment per message, so each call renders and tokenizes only the messages
    not seen before (``segmented``; ``segments=False`` turns it off). A conversation whose segments
    do not join to its whole render (checked when it is first seen) is rendered whole from then on,
    as is every conversation where the template does not allow segments: ``render_text`` then
    holds the template's full render.

    Caches belong to one instance: a server keeps one per API key (``sibling``), so what one key
    sent never shapes another key's renders or their timing."""

    def __init__(self, tokenizer, cache_size: int = 65536, segments: bool = True,
                 render_text: RenderText | None = None, check: TemplateCheck | None = None,
                 cache: SegmentCache | None = None):
        self.tokenizer = tokenizer
        render = render_text or transformers_render(tokenizer)
        self._render_full: RenderText = lambda m, t, g: render(m, t, g) if m else ""   # noqa: E731
        self._render_text = render
        self._cache_size = cache_size
        self.count_text = lru_cache(maxsize=cache_size)(self._tokens_in)
        self._bounds: OrderedDict[str, int] = OrderedDict()
        self._wholes: OrderedDict[tuple, str] = OrderedDict()
        self._whole_only: OrderedDict[tuple, None] = OrderedDict()   # conversations whose segments did not join
        self._lock = threading.Lock()
        self.known = KnownMessages()
        self._cache = cache or SegmentCache()
        self._edges = Boundaries(tokenizer)
        # whole prompts (a conversation the template does not render by segments) tokenized
        # incrementally, exactly (see token_cache); a slow tokenizer tokenizes them whole
        self._tokens = TokenCache(Splits(tokenizer), max_slots=256, max_bytes=256 << 20) \
            if getattr(tokenizer, "is_fast", False) else None
        if check is None:
            check = check_template(self._render_full, getattr(tokenizer, "chat_template", None)) if segments \
                else TemplateCheck("turned off")
        self.check = check
        self.not_segmented, self._tools_free = check.reason, check.tools_free
        if self.not_segmented and segments and check.reason != "turned off":
            log.info("the chat template renders whole conversations (%s)", self.not_segmented)

    def sibling(self, cache: SegmentCache | None = None) -> PromptRenderer:
        """A renderer with the same tokenizer, render and template check, and caches of its own."""
        return PromptRenderer(self.tokenizer, self._cache_size, render_text=self._render_text, check=self.check,
                              cache=cache)

    @property
    def segmented(self) -> bool:
        return self.not_segmented is None

    @classmethod
    def from_pretrained(cls, path: str, segments: bool = True) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), segments=segments)

    def _whole(self, messages: list[Message], tools: list | None) -> str:
        """The whole prompt's text where the template renders whole conversations, kept for the
        last few conversations: a request counts its prompt, then sends its ids, rendering once."""
        key = (*self.known.keys(messages), message_key(tools or []))
        with self._lock:
            text = self._wholes.get(key)
        if text is None:
            text = self._render_full(messages, tools, True)
            with self._lock:
                self._wholes[key] = text
                while len(self._wholes) > 8:
                    self._wholes.popitem(last=False)
        return text

    def render_text(self, messages: list[Message], tools: list | None, generation_prompt: bool) -> str:
        """The prompt text, as the chat template renders it."""
        p = self._prompt(messages, tools)
        if p is None:
            return self._render_full(messages, tools, generation_prompt)
        return p[0].text + (p[1].text if generation_prompt else "")

    def _tokens_in(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as ``tokenizer(text, add_special_tokens=False)`` gives them: a
        fast tokenizer's backend is called directly (one text at a time for a few: a batch wakes
        the backend's thread pool, which costs more than small texts do)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is None:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if len(texts) <= 8:
            return [backend.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    # -- segments (see prompt_segments) ------------------------------------------------------
    def _prompt(self, messages: list[Message], tools: list | None) -> tuple[Layout, Segment] | None:
        """The conversation's layout and generation prompt from cached segments, rendering only
        the segments not seen before; None where the whole conversation must be rendered."""
        if not self.segmented or not messages:
            return None
        keys = self.known.keys(messages)
        tk = message_key(tools or [])
        with self._lock:
            if (tk, keys[0]) in self._whole_only:
                self._whole_only.move_to_end((tk, keys[0]))
                return None
        base, common = self._cache.longest(tk, keys)
        render = memo(self._render_full)
        try:
            if base is not None and common == len(keys) == len(base.keys):
                layout = base
            else:
                layout = self._extend(base, common, messages, keys, tools, tk, render)
            free = self._tools_free
            gen_key = ("gen", "" if free else tk, *(keys[j] for j in context(len(keys) - 1)), keys[-1])
            gen = self._segments([gen_key], lambda _: generation_text(render, messages, None if free else tools))[0]
        except NotLocal as exc:
            log.debug("rendering the whole conversation: %s", exc)
            return None
        if base is None and len(messages) > 1:  # a conversation seen for the first time: check it whole
            if render(messages, tools, True) != layout.text + gen.text:
                self.render_whole(messages, tools)
                log.info("a conversation's segments did not join to its whole render: it is rendered whole")
                return None
        return layout, gen

    def render_whole(self, messages: list[Message], tools: list | None) -> None:
        """Render this conversation (its tools and first message) whole from now on."""
        with self._lock:
            self._whole_only[(message_key(tools or []), self.known.keys(messages[:1])[0])] = None
            while len(self._whole_only) > 4096:
                self._whole_only.popitem(last=False)

    def _segments(self, keys: list[tuple], text_of) -> list[Segment]:
        """Cached segments for ``keys``; the missing ones rendered (``text_of(i)``) and tokenized
        together."""
        out: list[Segment | None] = [self._cache.segment(k) for k in keys]
        missing = [i for i, s in enumerate(out) if s is None]
        if missing:
            texts = [text_of(i) for i in missing]
            ids = self._encode(texts)
            for i, text, tokens in zip(missing, texts, ids):
                s = Segment(text, array("i", tokens), self._edges.clean_start(text))
                self._cache.put_segment(keys[i], s)
                out[i] = s
        return out  # type: ignore[return-value]

    def _extend(self, base: Layout | None, common: int, messages: list[Message], keys: list[str],
                tools: list | None, tk: str, render: RenderText) -> Layout:
        n = len(messages)
        free = self._tools_free  # segments after the first rendered without the tool signatures
        seg_keys = [("" if i and free else tk, *(keys[j] for j in context(i)), keys[i]) for i in range(common, n)]
        new = self._segments(seg_keys, lambda j: segment_text(render, messages, common + j,
                                                              None if common + j and free else tools))
        segments = (base.segments[:common] if base else []) + new
        chars = base.chars[:common] if base else []
        ends = base.ends[:common] if base else []
        first_unclean = base.first_unclean if base and base.first_unclean < common else n
        c, t = (chars[-1], ends[-1]) if chars else (0, 0)
        for i, s in enumerate(new, common):
            c, t = c + len(s.text), t + len(s.ids)
            chars.append(c)
            ends.append(t)
            if i and first_unclean == n and not self._edges.clean(segments[i - 1].text, s):
                first_unclean = i
        layout = Layout(tk, keys, segments, chars, ends, first_unclean)
        base_ids = base.ids if base is not None else None
        if base is not None and base_ids is not None:
            self._cache.keep_ids(layout, base_ids[:base.ends[common - 1] if common else 0] +
                                 [x for s in new for x in s.ids])
        self._cache.put_layout(layout, base if base is not None and common == len(base.keys) else None)
        return layout

    # -- the prompt --------------------------------------------------------------------------
    def char_bounds(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """Character offset where each message's rendering ends (without the generation prompt).
        From the segments where the template allows; else cached along the conversation (key:
        hash of tools and all messages up to that one), rendering the prefixes not seen."""
        p = self._prompt(messages, tools)
        if p is not None:
            return list(p[0].chars)
        h = message_key(tools or [])
        out: list[int] = []
        for i, k in enumerate(self.known.keys(messages)):
            h = hashlib.sha256((h + k).encode()).hexdigest()
            with self._lock:
                n = self._bounds.get(h)
            if n is None:
                try:
                    n = len(self._render_full(messages[: i + 1], tools, False))
                except Exception:  # noqa: BLE001 - a prefix the template refuses (no user message yet):
                    n = out[-1] if out else 0   # its message joins the next one's range
                with self._lock:
                    self._bounds[h] = n
                    while len(self._bounds) > 65536:
                        self._bounds.popitem(last=False)
            out.append(n)
        return out

    def render(self, messages: list[Message], tools: list | None = None) -> RenderedPrompt:
        """The whole prompt's tokens; message 0's range also holds the header (tool signatures)."""
        p = self._prompt(messages, tools)
        slot = (message_key(tools or []), *self.known.keys(messages[:1]))
        if p is not None:
            layout, gen = p
            if layout.first_unclean == len(layout.keys) and self._edges.clean(layout.segments[-1].text, gen):
                ids = layout.ids
                if ids is None:
                    ids = [x for s in layout.segments for x in s.ids]
                    self._cache.keep_ids(layout, ids)
                ends = layout.ends
                return RenderedPrompt(layout.text + gen.text, ids + gen.ids.tolist(), list(zip([0] + ends[:-1], ends)))
            return self._tokenize(slot, layout.text + gen.text, layout.chars)
        return self._tokenize(slot, self._whole(messages, tools), self.char_bounds(messages, tools))

    def _tokenize(self, slot: tuple, text: str, bounds: list[int]) -> RenderedPrompt:
        """``text`` tokenized (incrementally in ``slot``), each message's range from its character
        bound (a bound that does not fall in order with the others joins its message to the next)."""
        starts: array | list[int]   # each token's first character
        if self._tokens is not None:
            done = self._tokens.tokenized(slot, text, self._encode_offsets)
            ids, starts = done.ids.tolist(), done.starts
        else:
            ids, offsets = self._encode_offsets(text)
            starts = [a for a, _ in offsets]
        ranges, t = [], 0
        for b in bounds:
            s = t
            t = max(t, bisect_left(starts, b))
            ranges.append((s, t))
        return RenderedPrompt(text, ids, ranges)

    def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]

    def count(self, messages: list[Message], tools: list | None = None) -> int:
        """Prompt tokens: from per-message segments tokenized once where every boundary between
        them falls on a special token, else the whole prompt's tokens (tokenized incrementally)."""
        if not messages:
            return 0
        p = self._prompt(messages, tools)
        if p is not None and p[0].first_unclean == len(p[0].keys) and self._edges.clean(p[0].segments[-1].text, p[1]):
            return p[0].ends[-1] + len(p[1].ids)
        return len(self.render(messages, tools).token_ids)
