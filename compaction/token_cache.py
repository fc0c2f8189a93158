"""A conversation's prompt tokenized incrementally: each turn tokenizes only the text after the
last boundary it shares with the previous turn's prompt.

vLLM tokenizes a rendered prompt whole (``tokenizer(text, add_special_tokens=False)``): at 200k
tokens that is ~0.3 s of a turn, for text that is, but for the new turn, the text of the previous
one. Here each conversation (a ``Slot``: one key's conversation branch, never shared across keys)
keeps its last prompt's text, ids and *cuts*, and the next prompt reuses the previous ids up to a
cut and tokenizes the rest alone. The result is the whole text's tokenization, by this argument:

- A fast (HF ``tokenizers``) tokenizer first splits the text on its added tokens (a leftmost-
  longest match of their contents); each piece between them is then normalized, pre-tokenized and
  encoded on its own. So the ids of a text are the ids of its pieces, in order.
- A *cut* is where the previous tokenization produced an added token that splits the text: not
  ``lstrip`` (it would eat the text before it), not ``single_word`` (its match depends on the
  character after it), not ``normalized`` (matched after normalization, not in the raw text), and
  not a proper prefix of an ``lstrip`` or ``single_word`` added token (the new text may extend it
  into that one, whose match then depends on the text before the cut). The previous tokenization
  is the evidence: the tokenizer itself put that token at that offset.
- A cut at character ``c`` is reused only where the new text equals the previous one byte for byte
  up to the cut token's end, and no added token's text occurs in the new text starting before ``c``
  and ending after it (which would move the split). Then the new text splits at ``c`` as the old
  one did, every piece before ``c`` is the same piece, and the ids before it are the previous ids
  before it; the text from ``c`` on, tokenized alone, starts with the same added token and splits
  the same way after it (a piece's encoding does not depend on what precedes the added token; a
  pre-tokenizer's ``prepend_scheme: first`` applies to offset 0 only, which the added token holds).

Comparison is by exact text (``str`` equality is code-point exact): nothing here is found by
Python equality of parsed JSON (``10 == 10.0``). ``tests/server/render/test_render_differential.py``
checks the result against vLLM's own tokenization over real chat templates and two tokenizer families. The
front's ids to vLLM (``server.render.engine_chat``) and the context step's counts of whole
conversations (``prompt.PromptRenderer``) both tokenize through it.
"""

from __future__ import annotations

import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

Encode = Callable[[str], tuple[list[int], list[tuple[int, int]]]]   # text -> (ids, character offsets)
CHUNK = 1 << 16


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (compared in C, a chunk at a time)."""
    if b.startswith(a):
        return len(a)
    n, i = min(len(a), len(b)), 0
    while i < n and a[i:i + CHUNK] == b[i:i + CHUNK]:
        i += CHUNK
    lo, hi = i, min(i + CHUNK, n)   # the first difference lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i:mid] == b[i:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Splits:
    """One tokenizer's added tokens: which of them make cuts, and whether one spans a position."""

    def __init__(self, tokenizer):
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        # tokens whose match depends on what precedes them: a cut may not be a proper prefix of one
        context = [t.content for t in added.values() if t.content and (t.lstrip or t.single_word)]
        self.cutting = {i: t.content for i, t in added.items()
                        if t.content and not t.lstrip and not t.single_word and not t.normalized
                        and not any(len(c) > len(t.content) and c.startswith(t.content) for c in context)}
        by_first: dict[str, list[str]] = {}
        for t in added.values():
            if len(t.content or "") > 1:
                by_first.setdefault(t.content[0], []).append(t.content)
        self._by_first = by_first
        self.reach = max((len(c) for cs in by_first.values() for c in cs), default=1)

    def spanned(self, text: str, at: int) -> bool:
        """Some added token's text occurs in ``text`` starting before ``at`` and ending after it."""
        for p in range(max(0, at - self.reach + 1), at):
            for c in self._by_first.get(text[p], ()):
                if p + len(c) > at and text.startswith(c, p):
                    return True
        return False


@dataclass
class Tokenized:
    """A prompt's text, ids and each token's first character (``starts``), and its cuts:
    ``cut_chars[j]`` is where the j-th cutting added token starts in the text, ``cut_ends[j]``
    where it ends, ``cut_tokens[j]`` its index in the ids."""

    text: str
    ids: array
    starts: array
    cut_chars: list[int]
    cut_ends: list[int]
    cut_tokens: list[int]

    @property
    def nbytes(self) -> int:
        """Its memory: the text as Python holds it (1, 2 or 4 bytes a character), the arrays, the cuts."""
        return (sys.getsizeof(self.text) + self.ids.itemsize * len(self.ids) + self.starts.itemsize * len(self.starts)
                + 3 * 36 * len(self.cut_chars))


@dataclass
class Stats:
    """What the cache did (for ``bench`` and tests): prompts tokenized, tokens reused / tokenized."""

    prompts: int = 0
    reused_tokens: int = 0
    tokenized_chars: int = 0
    tokenized_tokens: int = 0


class TokenCache:
    """The last prompt of each slot, least recently used out past ``max_slots`` or ``max_bytes``.
    Thread-safe: a slot's entry is replaced whole under the lock; tokenizing happens outside it."""

    def __init__(self, splits: Splits, max_slots: int = 1024, max_bytes: int = 512 << 20):
        self.splits, self.max_slots, self.max_bytes = splits, max_slots, max_bytes
        self._slots: OrderedDict[Hashable, Tokenized] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = Stats()

    def _get(self, slot: Hashable) -> Tokenized | None:
        with self._lock:
            found = self._slots.get(slot)
            if found is not None:
                self._slots.move_to_end(slot)
            return found

    def _put(self, slot: Hashable, entry: Tokenized) -> None:
        with self._lock:
            old = self._slots.pop(slot, None)
            self._bytes -= old.nbytes if old is not None else 0
            self._slots[slot] = entry
            self._bytes += entry.nbytes
            while len(self._slots) > 1 and (len(self._slots) > self.max_slots or self._bytes > self.max_bytes):
                self._bytes -= self._slots.popitem(last=False)[1].nbytes

    def _cut(self, prev: Tokenized, text: str) -> int:
        """The index of the last cut of ``prev`` that ``text`` can be tokenized after (-1: none)."""
        same = common_prefix(prev.text, text)
        j = bisect_right(prev.cut_ends, same) - 1   # cut_ends ascend with the cuts
        while j >= 0 and self.splits.spanned(text, prev.cut_chars[j]):
            j -= 1
        return j

    def tokenize(self, slot: Hashable, text: str, encode: Encode) -> list[int]:
        """``text``'s ids, equal to ``encode(text)[0]``, reusing the slot's previous prompt where
        the module's argument allows; the slot then holds ``text``."""
        return self.tokenized(slot, text, encode).ids.tolist()

    def tokenized(self, slot: Hashable, text: str, encode: Encode) -> Tokenized:
        """As ``tokenize``, the whole entry (its ``starts`` too; do not change it)."""
        prev = self._get(slot)
        if prev is not None and prev.text == text:
            return prev
        j = self._cut(prev, text) if prev is not None else -1
        base = prev if j >= 0 else None   # the previous prompt, where one of its cuts is reused
        start, first = (base.cut_chars[j], base.cut_tokens[j]) if base is not None else (0, 0)
        ids, offsets = encode(text[start:] if start else text)
        out = base.ids[:first] if base is not None else array("i")
        out.extend(ids)
        starts = base.starts[:first] if base is not None else array("i")
        starts.extend(start + a for a, _ in offsets)
        chars: list[int] = base.cut_chars[:j] if base is not None else []
        ends: list[int] = base.cut_ends[:j] if base is not None else []
        tokens: list[int] = base.cut_tokens[:j] if base is not None else []
        cutting = self.splits.cutting
        for k, (tid, (a, b)) in enumerate(zip(ids, offsets)):
            content = cutting.get(tid)
            if content is not None and text.startswith(content, start + a) and b - a == len(content):
                chars.append(start + a)
                ends.append(start + b)
                tokens.append(first + k)
        entry = Tokenized(text, out, starts, chars, ends, tokens)
        self._put(slot, entry)
        s = self.stats
        s.prompts += 1
        s.reused_tokens += first
        s.tokenized_chars += len(text) - start
        s.tokenized_tokens += len(ids)
        return entry

    def forget(self, slot: Hashable) -> None:
        with self._lock:
            old = self._slots.pop(slot, None)
            self._bytes -= old.nbytes if old is not None else 0
