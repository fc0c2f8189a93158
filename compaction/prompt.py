"""The exact prompt the engine sees, with each message's token range; token counting per message.

Rendering uses the served model's tokenizer and chat template (transformers). A message's range is
found by rendering prefixes: message ``i`` spans from the end of ``render(messages[:i])`` to the end
of ``render(messages[:i+1])``, which holds for templates that render messages in order (ChatML and
the like). Counting is incremental: each message's segment is tokenized once and cached.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .prompt_segments import (Boundaries, Layout, NotLocal, RenderText, Segment, SegmentCache, TemplateCheck,
                              check_template, context, generation_text, memo, segment_text)

Message = dict[str, Any]
log = logging.getLogger("agentkv.prompt")


def content_text(content) -> str:
    """A message's text: the string itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


BILLING_HEADER = "x-anthropic-billing-header"   # Claude Code's per-request line, which vLLM drops


def _text_of(part) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return None


def _without_billing_header(content):
    """A system message's content less Claude Code's billing-header line, as vLLM drops it (a
    string stays a string, parts stay parts)."""
    if isinstance(content, str):
        return content.partition("\n")[2] if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list) or not any((_text_of(p) or "").startswith(BILLING_HEADER) for p in content):
        return content
    out = []
    for p in content:
        text = _text_of(p)
        if text is None or not text.startswith(BILLING_HEADER):
            out.append(p)
        elif rest := text.partition("\n")[2]:
            out.append({**p, "text": rest} if isinstance(p, dict) else rest)
    return out


_COMMON = ("role", "content", "name", "task")
_KEEP = {"assistant": frozenset(_COMMON + ("tool_calls", "reasoning", "reasoning_content")),
         "tool": frozenset(_COMMON + ("tool_call_id",)), "developer": frozenset(_COMMON + ("tools",)),
         None: frozenset(_COMMON)}   # the keys vLLM hands the template, by role
_DROPPED_NULL = frozenset(("tool_calls", "reasoning", "reasoning_content"))   # vLLM leaves these out when null


def template_text(template) -> str | None:
    """A tokenizer's chat template as one text (named templates, a dict, joined)."""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def takes_developer(template: str | None) -> bool:
    """Whether a chat template knows the developer role (vLLM's test: the quoted name in it)."""
    return bool(template) and ('"developer"' in template or "'developer'" in template)


def developer_as_system(messages: list[Message]) -> list[Message]:
    """What vLLM renders for a template that does not know the developer role: developer messages
    become system ones, and all system messages are merged into one at the start (their texts
    joined by blank lines, a message's text parts by newlines)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    conv = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m.get("role") == "developer" else m
            for m in messages]
    texts, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m.get("role") != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                 if (isinstance(p, dict) and "text" in p) or isinstance(p, str))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else conv


def as_engine_sees(messages: list[Message]) -> list[Message]:
    """Messages as vLLM hands them to the chat template, so our render matches the engine's token
    for token: tool-call arguments parsed from JSON strings into objects (invalid or non-object
    JSON becomes ``{}``), an empty ``tool_calls`` dropped, an assistant's ``reasoning`` (or
    ``reasoning_content``) given as both, a tool result's text parts joined with newlines,
    Claude Code's billing-header line dropped from a system message, and only the keys vLLM keeps
    (``_KEEP``; a developer message's ``tools`` always present)."""
    out = []
    for m in messages:
        role = m.get("role")
        keep = _KEEP.get(role, _KEEP[None])
        if any(k not in keep or (v is None and k in _DROPPED_NULL) for k, v in m.items()):
            m = {k: v for k, v in m.items() if k in keep and not (v is None and k in _DROPPED_NULL)}
        for k in ("name", "task"):
            if k in m and not isinstance(m[k], str):
                m = {x: v for x, v in m.items() if x != k}
        if role == "developer" and "tools" not in m:
            m = {**m, "tools": None}
        if role == "assistant":
            r = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
            if r is not None:
                m = {**m, "reasoning": r, "reasoning_content": r}
            if isinstance(m.get("tool_calls"), list) and not m["tool_calls"]:
                m = {k: v for k, v in m.items() if k != "tool_calls"}
        elif role == "tool" and isinstance(m.get("content"), list) and all(
                isinstance(p, dict) and p.get("type") == "text" for p in m["content"]):
            m = {**m, "content": "\n".join(p.get("text", "") for p in m["content"])}
        elif role == "system" and m.get("content"):
            content = _without_billing_header(m["content"])
            if content is not m["content"]:
                m = {**m, "content": content}
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


def engine_tools(tools: list | None) -> list | None:
    """Tools as vLLM hands them to the chat template (its ``ChatCompletionToolsParam`` dumped):
    a function's ``description`` and ``parameters`` present (null when missing), ``strict`` and
    ``defer_loading`` only when set (a tool's ``defer_loading`` also given to its function), no
    other keys. Anything that is not a function tool is left as it is (vLLM refuses it)."""
    if not tools:
        return tools
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            out.append(t)
            continue
        defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else t.get("defer_loading")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        f.update({k: v for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)) if v is not None})
        tool = {"type": "function", "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


def message_key(message: Message) -> str:
    return hashlib.sha256(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()


class KnownMessages:
    """``message_key`` of each message of a list, hashing only the messages past the longest prefix
    equal to a list seen recently: a conversation grows by appending, so its next request hashes
    only what is new. Lists are found by their first message's key and compared message by message
    with ``==`` (in C; no hashing, no JSON). What is compared against are private copies, so a
    message changed in place by a caller is never mistaken for the one seen."""

    def __init__(self, max_lists: int = 512, per_first: int = 16):
        self.max_lists, self.per_first = max_lists, per_first
        self._lists: OrderedDict[str, list[tuple[list[Message], list[str]]]] = OrderedDict()
        self._n = 0
        self._lock = threading.Lock()

    def keys(self, messages: list[Message]) -> list[str]:
        if not messages:
            return []
        k0 = message_key(messages[0])
        with self._lock:
            group = list(self._lists.get(k0, ()))
        best, common = None, 0
        for seen in group:
            c = _common_prefix(seen[0], messages)
            if c > common:
                best, common = seen, c
        if best is not None and common == len(messages) == len(best[0]):
            return list(best[1])
        copies = best[0][:common] if best else []
        keys = best[1][:common] if best else []
        for m in messages[common:]:
            copies.append(copy.deepcopy(m))
            keys.append(message_key(m))
        with self._lock:
            group = self._lists.setdefault(k0, [])
            if best is not None and common == len(best[0]) and best in group:  # extended: the old list is a prefix
                group.remove(best)
                self._n -= 1
            group.insert(0, (copies, keys))
            self._n += 1
            self._lists.move_to_end(k0)
            while len(group) > self.per_first:
                group.pop()
                self._n -= 1
            while self._n > self.max_lists:
                self._n -= len(self._lists.popitem(last=False)[1])
        return list(keys)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
    """Renders and counts with one tokenizer (``transformers.PreTrainedTokenizerBase``).

    Where the chat template allows (``prompt_segments.check_template``), a conversation's prompt is
    kept as one cached segment per message, so each call renders and tokenizes only the messages
    not seen before (``segmented``; ``segments=False`` turns it off). Otherwise every call renders
    the whole conversation: ``render_text`` then holds the template's full render."""

    def __init__(self, tokenizer, cache_size: int = 65536, segments: bool = True):
        self.tokenizer = tokenizer
        self.count_text = lru_cache(maxsize=cache_size)(self._tokens_in)
        self._bounds: dict[str, int] = {}
        self._wholes: OrderedDict[tuple, str] = OrderedDict()
        self.takes_developer = takes_developer(template_text(getattr(tokenizer, "chat_template", None)))
        self._lock = threading.Lock()
        self.known = KnownMessages()
        self._cache = SegmentCache()
        self._edges = Boundaries(tokenizer)
        self._tools: list[tuple[list, str]] = []
        check = check_template(self._render_full, getattr(tokenizer, "chat_template", None)) if segments \
            else TemplateCheck("turned off")
        self.not_segmented, self._tools_free = check.reason, check.tools_free
        if self.not_segmented and segments:
            log.info("the chat template renders whole conversations (%s)", self.not_segmented)

    @property
    def segmented(self) -> bool:
        return self.not_segmented is None

    @classmethod
    def from_pretrained(cls, path: str, segments: bool = True) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), segments=segments)

    def _render_full(self, messages: list[Message], tools: list | None, generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(as_engine_sees(messages), tools=engine_tools(tools) or None,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def _whole(self, messages: list[Message], tools: list | None) -> str:
        """The whole prompt's text where the template renders whole conversations, kept for the
        last few conversations: a request counts its prompt, then sends its ids, rendering once."""
        key = (*self.known.keys(messages), self._tools_key(tools))
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
    def _tools_key(self, tools: list | None) -> str:
        for seen, key in self._tools:
            if seen == (tools or []):
                return key
        key = message_key({"tools": tools or []})
        self._tools = [(copy.deepcopy(tools or []), key)] + self._tools[:7]
        return key

    def _prompt(self, messages: list[Message], tools: list | None) -> tuple[Layout, Segment] | None:
        """The conversation's layout and generation prompt from cached segments, rendering only
        the segments not seen before; None where the whole conversation must be rendered."""
        if not self.segmented or not messages:
            return None
        keys = self.known.keys(messages)
        tk = self._tools_key(tools)
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
                self.not_segmented = "a conversation's segments did not join to its full render"
                log.warning("the chat template does not render message by message: rendering whole "
                            "conversations from now on")
                return None
        return layout, gen

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
        if base_ids is not None:
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
        h = hashlib.sha256(json.dumps(tools or [], sort_keys=True, default=str).encode()).hexdigest()
        out = []
        for i, m in enumerate(messages):
            h = hashlib.sha256((h + message_key(m)).encode()).hexdigest()
            if h not in self._bounds:
                if len(self._bounds) > 65536:
                    self._bounds.clear()
                self._bounds[h] = len(self._render_full(messages[: i + 1], tools, False))
            out.append(self._bounds[h])
        return out

    def render(self, messages: list[Message], tools: list | None = None) -> RenderedPrompt:
        """The whole prompt's tokens; message 0's range also holds the header (tool signatures)."""
        p = self._prompt(messages, tools)
        if p is not None:
            layout, gen = p
            if layout.first_unclean == len(layout.keys) and self._edges.clean(layout.segments[-1].text, gen):
                ids = layout.ids
                if ids is None:
                    ids = [x for s in layout.segments for x in s.ids]
                    self._cache.keep_ids(layout, ids)
                ends = layout.ends
                return RenderedPrompt(layout.text + gen.text, ids + gen.ids.tolist(), list(zip([0] + ends[:-1], ends)))
            return self._tokenize(layout.text + gen.text, layout.chars)
        return self._tokenize(self._whole(messages, tools), self.char_bounds(messages, tools))

    def _tokenize(self, text: str, bounds: list[int]) -> RenderedPrompt:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        ranges, t = [], 0
        for b in bounds:
            s = t
            while t < len(ids) and offsets[t][0] < b:
                t += 1
            ranges.append((s, t))
        return RenderedPrompt(text, ids, ranges)

    def count(self, messages: list[Message], tools: list | None = None) -> int:
        """Prompt tokens, from per-message segments tokenized once (equal to
        ``len(render().token_ids)`` for templates whose message boundaries fall on special tokens)."""
        if not messages:
            return 0
        p = self._prompt(messages, tools)
        if p is not None:
            return p[0].ends[-1] + len(p[1].ids)
        bounds = [0] + self.char_bounds(messages, tools)
        full = self._whole(messages, tools)
        pieces = [full[a:b] for a, b in zip(bounds, bounds[1:])] + [full[bounds[-1]:]]
        return sum(self.count_text(p) for p in pieces if p)
