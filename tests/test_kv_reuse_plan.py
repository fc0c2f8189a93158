"""What the front asks the connector to move: every run maps equal token ids, placeholders come
from the priming prompt, and coverage is contiguous."""

from __future__ import annotations

import json

from agentkv.compaction.clearing import clear_tool_uses
from agentkv.compaction.config import ClearToolUses
from agentkv.kernels.connector import covered_runs, prompt_hash
from agentkv.server.kv_reuse import plan_reuse


def conversation(n: int = 3) -> list[dict]:
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"i": i})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}\n" + "noise line\n" * 60}]
    return msgs


def test_runs_map_equal_tokens_and_cover_the_cleared_prompt(renderer):
    src_ids = renderer.render(conversation()).token_ids           # the prompt the engine saved
    later = conversation() + [{"role": "user", "content": "and now?"}]
    r = clear_tool_uses(later, renderer, ClearToolUses(trigger=0, keep=1))
    assert r.edits
    plan = plan_reuse("src", src_ids, r.old_ids, r.new_ids, r.edits, "shift", 0.15)
    sources = {"src": src_ids, plan.prime_key: plan.prime_ids}
    for key, a, b, d in plan.load["runs"]:
        assert sources[key][a:b] == r.new_ids[d:d + (b - a)]
    assert plan.load["hash"] == prompt_hash(r.new_ids) and plan.load["recompute_tail"] == 0
    runs, end = covered_runs(plan.load["runs"], r.edits[0].start, len(r.new_ids))
    # everything the saved prompt holds is covered, up to its generation prompt (which the next
    # prompt replaces with the new user turn)
    shrink = sum(e.end - e.start - len(e.replacement_ids) for e in r.edits)
    assert end >= len(src_ids) - shrink - 3
    assert plan.planned_tokens > 0
    blend = plan_reuse("src", src_ids, r.old_ids, r.new_ids, r.edits, "blend", 0.5)
    assert blend.load["recompute_tail"] > 0 and blend.planned_tokens < plan.planned_tokens


def test_nothing_to_reuse_when_the_source_diverges_before_the_first_edit(renderer):
    later = conversation() + [{"role": "user", "content": "x"}]
    r = clear_tool_uses(later, renderer, ClearToolUses(trigger=0, keep=1))
    plan = plan_reuse("src", [1, 2, 3], r.old_ids, r.new_ids, r.edits, "shift", 0.0)
    assert plan.load is None and plan.prime_ids is None


def test_covered_runs_stops_at_gaps_and_limit():
    runs = [["a", 0, 10, 0], ["b", 5, 8, 10], ["a", 20, 30, 15]]
    out, end = covered_runs(runs, 4, 100)
    assert end == 13 and out == [("a", 4, 10, 4), ("b", 5, 8, 10)]      # gap at 13..15
    out, end = covered_runs(runs, 0, 7)
    assert end == 7 and out == [("a", 0, 7, 0)]
    assert covered_runs(runs, 40, 100) == ([], 40)
