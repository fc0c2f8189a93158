"""Which held tokens supply a new prompt's K/V after an edit: the connector's planning step.

The front says which edit happened: spans ``[start, end)`` of the session's previous prompt were
replaced by ``replacement`` tokens each. The connector holds that previous prompt's blocks (and a
priming prompt's: the shared prefix followed by every span's replacement tokens, back to back) and
sees vLLM's own token ids of the new prompt. A new position ``q`` takes its K/V from

- the held prompt at ``q`` itself, before the first span (vLLM's prefix cache usually has these);
- the priming prompt, for replacement tokens (computed there right after the shared prefix);
- the held prompt at ``q - shift``, for tokens the edit kept, ``shift`` being what the spans
  before ``q`` removed net of their replacements,

and only where the token ids are equal. Coverage is contiguous from where vLLM's own prefix hit
ends; it stops at the first position no source holds. Plain lists and numpy, no vLLM objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentkv.kernels.plan import Span

PROMPT, PRIME = 0, 1   # source indices: the held prompt, the held priming prompt


@dataclass(frozen=True)
class Run:
    """``length`` tokens from ``source`` positions ``src_start..`` to new positions ``dst_start..``;
    keys rotate by ``dst_start - src_start``."""

    source: int
    src_start: int
    dst_start: int
    length: int

    @property
    def delta(self) -> int:
        return self.dst_start - self.src_start


@dataclass(frozen=True)
class Coverage:
    runs: list[Run]
    end: int                 # new positions [start, end) are covered
    stop: str | None         # why coverage ended before the limit: "mismatch", "missing", "prefix" or None


def pieces(spans: Sequence[Span], limit: int) -> list[tuple[int, int, int, int]]:
    """``(new_lo, new_hi, source, src_minus_dst)`` pieces tiling new positions ``[0, limit)``."""
    spans = sorted(spans, key=lambda s: s.start)
    if not spans:
        return [(0, limit, PROMPT, 0)]
    first = spans[0].start
    out = [(0, first, PROMPT, 0)]
    shift = 0          # new - old after the spans so far
    primed = 0         # replacement tokens before this span (their place in the priming prompt)
    for i, s in enumerate(spans):
        lo = s.start + shift                          # the span's replacement starts here (new)
        out.append((lo, lo + s.replacement, PRIME, first + primed - lo))
        primed += s.replacement
        shift += s.delta
        nxt = spans[i + 1].start + shift if i + 1 < len(spans) else limit
        out.append((s.end + shift, max(s.end + shift, nxt), PROMPT, -shift))
    return [(lo, min(hi, limit), src, off) for lo, hi, src, off in out if lo < min(hi, limit)]


def cover(new_ids: Sequence[int], sources: Sequence[Sequence[int] | None], spans: Sequence[Span],
          start: int, limit: int) -> Coverage:
    """Runs covering new positions from ``start`` (before ``limit``) where a source holds the same
    token id; ``sources[PROMPT]`` / ``sources[PRIME]`` are the held token ids (None: not held).

    The K/V of a position depend on every token before it, so the new prompt's tokens before
    ``start`` (vLLM's own hit, which may come from another conversation's blocks) must equal the
    held ones they map to as well: where they differ nothing is covered (stop ``"prefix"``)."""
    new = np.asarray(new_ids, dtype=np.int64)
    arrays = [None if s is None else np.asarray(s, dtype=np.int64) for s in sources]
    if not _prefix_agrees(new, arrays, spans, start):
        return Coverage([], start, "prefix")
    runs: list[Run] = []
    pos = start
    for _lo, hi, src, off in pieces(spans, limit):
        if hi <= pos:
            continue
        held = arrays[src] if src < len(arrays) else None
        if held is None:
            return Coverage(runs, pos, "missing")
        q = np.arange(pos, hi)
        p = q + off
        inside = p < held.size
        same = inside & (held[np.minimum(p, held.size - 1)] == new[q]) if held.size else inside
        n = int(np.argmin(same)) if not same.all() else same.size
        if n:
            runs.append(Run(src, pos + off, pos, n))
        pos += n
        if n < same.size:
            return Coverage(runs, pos, "mismatch" if inside[n] else None)
    return Coverage(runs, pos, None)


def _prefix_agrees(new: np.ndarray, arrays: Sequence[np.ndarray | None], spans: Sequence[Span],
                   start: int) -> bool:
    """Whether every new position before ``start`` holds the token its source holds (a piece whose
    source is not held is not compared: replacement tokens vLLM already had)."""
    for lo, hi, src, off in pieces(spans, start):
        held = arrays[src] if src < len(arrays) else None
        if held is None:
            continue
        if lo + off < 0 or hi + off > held.size or not np.array_equal(held[lo + off:hi + off], new[lo:hi]):
            return False
    return True


def clip(runs: Sequence[Run], end: int) -> list[Run]:
    """The runs cut at new position ``end``."""
    out = []
    for r in runs:
        n = min(r.length, end - r.dst_start)
        if n > 0:
            out.append(Run(r.source, r.src_start, r.dst_start, n))
    return out
