"""A conversation's prompt as one cached segment per message: prompt work O(new messages).

For the chat templates this applies to, the prompt text of a conversation is the concatenation of
one segment per message (message 0's also holds the header: system text, tool signatures) and the
generation prompt, and segment ``i`` depends only on message ``i``, the one before it and the
first one (and the tools). A segment is then rendered from that reduced context,
``render(ctx + [m])`` minus ``render(ctx)`` with ``ctx`` = first message + previous message
(``context``), and tokenized alone, once; a conversation that grows by a message costs one small render and the
new message's tokens, not a render and a tokenization of the whole prompt.

When it holds, and what happens when it does not:
- the template: ``check_template`` renders probe conversations (every ordered pair of message
  kinds, a system message in the middle, tool calls and results, reasoning, content parts, with
  and without tools) and checks each segment and the generation prompt against the full render.
  A template that fails (one that re-renders earlier messages when later ones arrive, reorders
  system messages, groups tool results, reads the clock) never takes this path: every call renders
  the whole conversation, as before.
- real conversations: the first time a conversation is seen, its joined segments are compared
  with the full render; a mismatch logs a warning and turns the segment path off for good.
- a reduced render that raises, or whose prefix is not stable, sends that call to the full render.
- token ids: a segment's tokens, tokenized alone, are its tokens in the whole prompt when the
  boundary is *clean*: the segment starts with an added token the tokenizer splits on (no
  lstrip, no single_word, not normalized) and no added token spans the boundary. Counting uses the
  segments' tokens either way (as counting always did); ``render`` joins them only when every
  boundary is clean, and tokenizes the joined text otherwise (the template is still not re-run).
"""

from __future__ import annotations

import functools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
RenderText = Callable[[list[Message], "list | None", bool], str]


class NotLocal(Exception):
    """A reduced render did not give a segment (it raised, or its prefix was not stable)."""


@dataclass(frozen=True)
class Segment:
    text: str
    ids: array        # its tokens, tokenized alone (array('i'): 4 bytes a token in the cache)
    clean_start: bool  # starts with an added token the tokenizer splits on


@dataclass
class Layout:
    """A conversation's prompt: its messages' keys, segments, cumulative ends (characters and
    tokens of the prompt without the generation prompt), the first segment whose start boundary
    is not clean (``len(keys)``: none), and the joined token ids once someone asked for them."""

    tools_key: str
    keys: list[str]
    segments: list[Segment]
    chars: list[int]
    ends: list[int]
    first_unclean: int
    ids: list[int] | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


class Boundaries:
    """Which segment boundaries are clean for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer):
        added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
        self.splitting = tuple(sorted({t.content for t in added if t.content and not t.lstrip and not t.single_word
                                       and not t.normalized}, key=len, reverse=True))
        self.contents = tuple({t.content for t in added if t.content})
        self.reach = max((len(c) for c in self.contents), default=1)

    def clean_start(self, text: str) -> bool:
        return text.startswith(self.splitting) if self.splitting else False

    def clean(self, before: str, after: Segment) -> bool:
        """The boundary between text ending in ``before`` and segment ``after`` is clean."""
        if not after.clean_start:
            return False
        if not before:
            return True
        tail = before[-self.reach:]
        window = tail + after.text[:self.reach]
        # an added token that begins before the boundary and ends after it
        return not any(window.find(c, max(0, len(tail) - len(c) + 1), len(tail) + len(c) - 1) != -1
                       for c in self.contents if len(c) > 1)


def memo(render: RenderText) -> RenderText:
    """``render`` remembering its results by the identity of the messages and tools rendered (for
    one call's reduced contexts, which repeat: the previous message's context is the next one's)."""
    done: dict[tuple, str] = {}

    def cached(msgs: list[Message], tools, gen: bool) -> str:
        k = (tuple(map(id, msgs)), id(tools) if tools else None, gen)
        if k not in done:
            done[k] = render(msgs, tools, gen)
        return done[k]
    return cached


def context(i: int) -> list[int]:
    """The indices of the reduced context segment ``i`` is rendered after: the first message and
    the previous one, with the one before that where it keeps the previous message at an index of
    the same parity (templates that check roles alternate by index parity then accept it)."""
    if i < 2:
        return list(range(i))
    return [0, i - 1] if (i - 1) % 2 else [0, i - 2, i - 1]


def segment_text(render: RenderText, messages: list[Message], i: int, tools) -> str:
    ctx = [messages[j] for j in context(i)]
    try:
        before = render(ctx, tools, False)
        after = render(ctx + [messages[i]], tools, False)
    except Exception as exc:  # a template that rejects the reduced context (e.g. role order)
        raise NotLocal(f"{exc.__class__.__name__}: {exc}") from None
    if not after.startswith(before):
        raise NotLocal(f"message {i} re-renders the context before it")
    return after[len(before):]


def generation_text(render: RenderText, messages: list[Message], tools) -> str:
    ctx = [messages[j] for j in context(len(messages) - 1)] + messages[-1:]
    try:
        bare, prompt = render(ctx, tools, False), render(ctx, tools, True)
    except Exception as exc:
        raise NotLocal(f"{exc.__class__.__name__}: {exc}") from None
    if not prompt.startswith(bare):
        raise NotLocal("the generation prompt re-renders the conversation")
    return prompt[len(bare):]


_CALL = [{"id": "call_1", "type": "function", "function": {"name": "probe_tool", "arguments": '{"path": "a.py"}'}}]
_CALLS = _CALL + [{"id": "call_2", "type": "function", "function": {"name": "probe_tool", "arguments": "{}"}}]
PROBE_KINDS: list[Message] = [
    {"role": "system", "content": "System note."},
    {"role": "user", "content": "User asks."},
    {"role": "user", "content": [{"type": "text", "text": "User "}, {"type": "text", "text": "parts."}]},
    {"role": "assistant", "content": "Assistant says."},
    {"role": "assistant", "content": None, "tool_calls": _CALL},
    {"role": "assistant", "content": "Calling two.", "tool_calls": _CALLS},
    {"role": "assistant", "content": "Thought through.", "reasoning": "Reasoning here.",
     "reasoning_content": "Reasoning here."},
    {"role": "tool", "tool_call_id": "call_1", "content": "Result one."},
    {"role": "tool", "tool_call_id": "call_2", "content": "Result two."},
]
PROBE_TOOLS = [{"type": "function", "function": {"name": n, "description": "a probe", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}} for n in ("probe_tool", "other_tool")]
CLOCK = ("strftime_now", "now(")


@dataclass(frozen=True)
class TemplateCheck:
    """``reason``: None when the template renders message by message (else why not);
    ``tools_free``: the segments after the first and the generation prompt do not depend on the
    tools (their reduced renders then leave the tool signatures out, which can be most of a
    small render's cost)."""

    reason: str | None
    tools_free: bool = False


def check_template(render: RenderText, template: Any) -> TemplateCheck:
    """Every probe conversation's segments and generation prompt, rendered from their reduced
    contexts, against the full render's."""
    source = template if isinstance(template, str) else str(template or "")
    if any(c in source for c in CLOCK):
        return TemplateCheck("the template reads the clock")
    full = memo(render)
    checked, tools_free = 0, True
    user, assistant = PROBE_KINDS[1], PROBE_KINDS[3]
    for start in ([PROBE_KINDS[0], user, assistant], [user, assistant, user]):
        for tools in (None, PROBE_TOOLS):
            for a in PROBE_KINDS:
                for b in PROBE_KINDS:
                    msgs = start + [a, b]
                    try:
                        texts = [full(msgs[:i + 1], tools, False) for i in range(len(msgs))]
                        prompt = full(msgs, tools, True)
                    except Exception:  # an order this template refuses: the engine would refuse it too
                        continue
                    try:
                        for i in range(1, len(msgs)):
                            seg = segment_text(full, msgs, i, tools)
                            if texts[i] != texts[i - 1] + seg:
                                return TemplateCheck(f"a {msgs[i]['role']} message after a {msgs[i - 1]['role']} "
                                                     "message does not render on its own")
                            if tools and tools_free:
                                tools_free = _same_without_tools(seg,
                                                                 functools.partial(segment_text, full, msgs, i, None))
                        gen = generation_text(full, msgs, tools)
                        if prompt != texts[-1] + gen:
                            return TemplateCheck("the generation prompt is not appended to the conversation")
                        if tools and tools_free:
                            tools_free = _same_without_tools(gen, functools.partial(generation_text, full, msgs, None))
                    except NotLocal as exc:
                        return TemplateCheck(str(exc))
                    checked += 1
    return TemplateCheck(None, tools_free) if checked else TemplateCheck("no probe conversation renders")


def _same_without_tools(text: str, without) -> bool:
    try:
        return without() == text
    except NotLocal:
        return False


class SegmentCache:
    """Segments by (tools, reduced context, message) key and layouts of recently seen
    conversations by (tools, first message), each bounded (least recently used first out).
    Thread-safe: the structures change under a lock; rendering and tokenizing happen outside it."""

    def __init__(self, max_segments: int = 65536, max_tokens: int = 8_000_000, max_layouts: int = 512,
                 max_id_tokens: int = 4_000_000):
        self.max_segments, self.max_tokens, self.max_layouts = max_segments, max_tokens, max_layouts
        self.max_id_tokens = max_id_tokens  # joined id lists kept (a list costs ~36 bytes a token)
        self._segments: OrderedDict[tuple, Segment] = OrderedDict()
        self._tokens = 0
        self._layouts: OrderedDict[tuple[str, str], list[Layout]] = OrderedDict()
        self._n_layouts = 0
        self._with_ids: OrderedDict[int, Layout] = OrderedDict()
        self._id_tokens = 0
        self._lock = threading.Lock()

    def keep_ids(self, layout: Layout, ids: list[int]) -> None:
        """Give ``layout`` its joined ids; the least recently given lose theirs past the budget
        (they are joined again from the segments when asked for)."""
        with self._lock:
            if layout.ids is None:
                self._id_tokens += len(ids)
            else:
                self._with_ids.move_to_end(id(layout))
            layout.ids = ids
            self._with_ids[id(layout)] = layout
            while self._id_tokens > self.max_id_tokens and len(self._with_ids) > 1:
                _, old = self._with_ids.popitem(last=False)
                self._id_tokens -= len(old.ids or ())
                old.ids = None

    def segment(self, key: tuple) -> Segment | None:
        with self._lock:
            s = self._segments.get(key)
            if s is not None:
                self._segments.move_to_end(key)
            return s

    def put_segment(self, key: tuple, s: Segment) -> None:
        with self._lock:
            if key in self._segments:
                return
            self._segments[key] = s
            self._tokens += len(s.ids)
            while len(self._segments) > self.max_segments or self._tokens > self.max_tokens:
                _, old = self._segments.popitem(last=False)
                self._tokens -= len(old.ids)

    def longest(self, tools_key: str, keys: list[str]) -> tuple[Layout | None, int]:
        """The seen layout sharing the longest prefix with ``keys``, and that prefix's length."""
        with self._lock:
            group = self._layouts.get((tools_key, keys[0]))
            if group is None:
                return None, 0
            self._layouts.move_to_end((tools_key, keys[0]))
            best, common = None, 0
            for layout in group:
                n = len(layout.keys)
                if n <= len(keys) and layout.keys == keys[:n]:
                    c = n
                else:
                    c = 0
                    for x, y in zip(layout.keys, keys):
                        if x != y:
                            break
                        c += 1
                if c > common:
                    best, common = layout, c
            return best, common

    def put_layout(self, layout: Layout, replaces: Layout | None) -> None:
        """Remember ``layout``; ``replaces``: the layout it extends (forgotten, it is a prefix)."""
        k = (layout.tools_key, layout.keys[0])
        with self._lock:
            group = self._layouts.setdefault(k, [])
            if replaces is not None and any(x is replaces for x in group):
                group.remove(replaces)
                self._drop(replaces)
            group.insert(0, layout)
            self._n_layouts += 1
            self._layouts.move_to_end(k)
            while len(group) > 16:
                self._drop(group.pop())
            while self._n_layouts > self.max_layouts:
                for old in self._layouts.popitem(last=False)[1]:
                    self._drop(old)

    def _drop(self, layout: Layout) -> None:
        """A layout forgotten (under the lock): its joined ids go with it."""
        self._n_layouts -= 1
        if self._with_ids.pop(id(layout), None) is not None:
            self._id_tokens -= len(layout.ids or ())
            layout.ids = None
