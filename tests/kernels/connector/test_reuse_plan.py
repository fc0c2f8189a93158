"""The connector's planning step: which held tokens supply a new prompt after clearing. Every run
maps equal token ids, placeholders come from the priming prompt, coverage is contiguous and stops
where the held prompt stops matching."""

from __future__ import annotations

import json

from agentkv.compaction.clearing import clear_tool_uses
from agentkv.compaction.config import ClearToolUses
from agentkv.kernels.connector.reuse_plan import PRIME, PROMPT, Run, clip, cover, pieces
from agentkv.kernels.plan import Span


def conversation(n: int = 3) -> list[dict]:
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"i": i})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}\n" + "noise line\n" * 60}]
    return msgs


def cleared(renderer):
    held = renderer.render(conversation()).token_ids                 # the prompt the engine held
    later = conversation() + [{"role": "user", "content": "and now?"}]
    r = clear_tool_uses(later, renderer, ClearToolUses(trigger=0, keep=1))
    assert len(r.edits) == 2
    spans = [Span(e.start, e.end, len(e.replacement_ids)) for e in r.edits]
    prime = r.old_ids[:r.edits[0].start] + [t for e in r.edits for t in e.replacement_ids]
    return held, prime, spans, r


def test_runs_map_equal_tokens_and_cover_what_the_held_prompt_had(renderer):
    held, prime, spans, r = cleared(renderer)
    start = r.edits[0].start // 16 * 16                             # a block-aligned local prefix hit
    cov = cover(r.new_ids, [held, prime], spans, start, len(r.new_ids) - 1)
    sources = {PROMPT: held, PRIME: prime}
    assert cov.runs[0].dst_start == start and cov.runs[0].source == PROMPT and cov.runs[0].delta == 0
    pos = start
    for run in cov.runs:                                            # contiguous, equal ids
        assert run.dst_start == pos
        assert sources[run.source][run.src_start:run.src_start + run.length] == \
            r.new_ids[run.dst_start:run.dst_start + run.length]
        pos += run.length
    assert pos == cov.end
    assert {run.source for run in cov.runs} == {PROMPT, PRIME}
    assert sum(run.length for run in cov.runs if run.source == PRIME) == sum(s.replacement for s in spans)
    # kept tokens shift down by what the spans removed; everything the held prompt had is covered
    # up to its generation prompt, which the new prompt continues with the assistant's turn
    shrink = sum(s.end - s.start - s.replacement for s in spans)
    assert cov.runs[-1].delta == -shrink
    assert len(held) - shrink - 3 <= cov.end <= len(held) - shrink
    assert cov.stop in ("mismatch", None)


def test_coverage_stops_where_a_source_is_missing_or_differs(renderer):
    held, prime, spans, r = cleared(renderer)
    start = r.edits[0].start
    no_prime = cover(r.new_ids, [held, None], spans, start, len(r.new_ids) - 1)
    assert no_prime.end == start and no_prime.stop == "missing" and no_prime.runs == []
    changed = list(held)
    k = r.edits[1].end + 5                                          # a kept token after the second span
    changed[k] += 1
    cov = cover(r.new_ids, [changed, prime], spans, start, len(r.new_ids) - 1)
    shift = sum(s.delta for s in spans)
    assert cov.end == k + shift and cov.stop == "mismatch"
    other = cover(r.new_ids, [[t + 1 for t in held], prime], spans, 0, len(r.new_ids) - 1)
    assert other.end == 0 and other.stop == "mismatch"


def test_pieces_tile_the_new_prompt():
    spans = [Span(10, 20, 2), Span(30, 31, 4)]                      # -8, then +3
    assert pieces(spans, 100) == [(0, 10, PROMPT, 0), (10, 12, PRIME, 0), (12, 22, PROMPT, 8),
                                  (22, 26, PRIME, -10), (26, 100, PROMPT, 5)]
    assert pieces([], 7) == [(0, 7, PROMPT, 0)]


def test_clip_cuts_runs_at_the_end():
    runs = [Run(PROMPT, 0, 0, 10), Run(PRIME, 10, 10, 5), Run(PROMPT, 30, 15, 20)]
    assert clip(runs, 12) == [Run(PROMPT, 0, 0, 10), Run(PRIME, 10, 10, 2)]
    assert clip(runs, 0) == []


def test_nothing_is_covered_where_the_tokens_before_the_start_differ(renderer):
    """The K/V of a held position depend on every held token before it: coverage from vLLM's hit
    needs the tokens before the hit to agree as well (the hit may be another conversation's)."""
    held, prime, spans, r = cleared(renderer)
    start = r.edits[0].start // 16 * 16
    changed = list(r.new_ids)
    changed[3] += 1                                                 # before the hit, before any span
    cov = cover(changed, [held, prime], spans, start, len(changed) - 1)
    assert cov.end == start and cov.stop == "prefix" and cov.runs == []
    plain = cover(held, [held], [], 32, len(held) - 1)              # no edit: from the hit to the end
    assert plain.end == len(held) - 1 and plain.runs == [Run(PROMPT, 32, 32, len(held) - 33)]
    other = list(held)
    other[5] += 1
    assert cover(other, [held], [], 32, len(held) - 1).stop == "prefix"
