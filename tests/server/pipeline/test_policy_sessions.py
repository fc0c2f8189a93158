"""The default context policy judged on whole agent sessions: the prompt the front sends each turn,
with a perfect prefix cache, against the floor (the same session unmanaged on an unlimited window:
its new content only). Clearing breaks the prefix cache after the first cleared result, so the
policy must clear rarely and in batches that buy many turns (issue 39)."""

from __future__ import annotations

import json
import random

import pytest

from agentkv.benchmarks.session_cost import replay, totals
from agentkv.compaction.log.open import open_session_log
from agentkv.server.config import ServeConfig
from agentkv.server.pipeline.context import ContextManager
from agentkv.server.pipeline.sessions import Sessions

WORDS = ("def class return import self value config error path line test cache block token request "
         "session window prompt result tool server engine module write read grep").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def agent_session(seed: int, fixed_words: int, turns: int, result_words: tuple[int, int]) -> tuple[list, list]:
    """A coding agent's session (Claude Code's shape): a long system prompt and tool schemas, one
    task, then tool calls and their results, now and then a line of text; the requests it sends."""
    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": n, "description": _text(rng, fixed_words // 8),
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}}}}
             for n in ("Read", "Grep", "Bash", "Glob")]
    msgs = [{"role": "system", "content": _text(rng, fixed_words // 2)},
            {"role": "user", "content": "Find why the cache misses after a clear and fix it."}]
    requests = [list(msgs)]
    for i in range(turns):
        name = rng.choice(["Read", "Grep", "Bash", "Glob"])
        msgs.append({"role": "assistant", "content": _text(rng, 8) if rng.random() < 0.3 else None,
                     "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                         "name": name, "arguments": json.dumps({"path": f"src/{rng.choice(WORDS)}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": _text(rng, rng.randint(*result_words))})
        requests.append(list(msgs))
    return requests, tools


@pytest.mark.parametrize("seed", [1, 2])
def test_the_default_policy_clears_rarely_and_costs_little_over_the_floor(renderer, tmp_path, seed):
    """Claude Code's proportions (the issue's session: system prompt and tools 44% of the window,
    a tool result about 6% of it a turn), 30 tool turns growing to about 2.5 windows: every prompt
    fits, clearing fires a handful of times and never on two turns in a row, and the engine
    computes at most 1.15x the floor (the old default, clearing at half the window in batches of
    a tenth, computed 1.61x it on the real session)."""
    window = 32768
    requests, tools = agent_session(seed, fixed_words=7500, turns=30, result_words=(500, 2000))
    ctx = ContextManager(Sessions(open_session_log(tmp_path / "log.db")), renderer, None)
    rows = replay(ctx, window, requests, tools, ServeConfig())
    t = totals(rows)
    assert 0.4 * window < rows[0].floor_prompt < 0.5 * window
    assert rows[-1].floor_prompt > 2.2 * window                      # unmanaged, it would not fit
    assert t["max_prompt"] < window
    assert 2 <= len(t["edit_turns"]) <= 6, t
    assert all(b - a > 1 for a, b in zip(t["edit_turns"], t["edit_turns"][1:])), t
    assert t["ratio"] <= 1.15, t
