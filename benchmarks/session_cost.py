"""What a multi-turn agent session costs the engine under a context policy, judged in the front.

A session is the list of requests its client sent, turn by turn (each request's messages extend
the previous one's). The front's context step runs on each, as the server runs it (the session
log, the view state kept between turns, the default policy from the request's fixed part), and
the prompt it would send is compared with the previous turn's: with a perfect prefix cache the
engine computes only the tokens after their common prefix. The **floor** is the same count for the
session unmanaged on an unlimited window (its new content only). ``bench sessions`` measures the
same quantities on the real engine; this is its exact, engine-free counterpart (and the policy's
test).
"""

from __future__ import annotations

from dataclasses import dataclass


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class TurnCost:
    turn: int
    prompt_tokens: int       # what the engine gets (after the context step)
    computed: int            # ... of which not in the previous turn's prompt (perfect prefix cache)
    floor_prompt: int        # the unmanaged prompt's size
    floor: int               # ... and its new tokens
    edits: list[str]         # the edits that fired


def replay(ctx, window: int, turns: list[list[dict]], tools: list | None, cfg, owner: str = "bench",
           session: str = "s") -> list[TurnCost]:
    """Run ``turns`` (each the messages of one request) through ``ctx`` (a ``ContextManager``)
    with the server's default policy of ``cfg`` (a ``ServeConfig``) for a ``window``-token model."""
    from agentkv.compaction.policy import default_policy, with_defaults
    from agentkv.server.pipeline.sessions import SessionRef
    from agentkv.server.pipeline.window import fixed_part

    renderer = ctx.renderer_for(owner)
    rows: list[TurnCost] = []
    prev: list[int] = []
    prev_floor: list[int] = []
    for t, messages in enumerate(turns):
        fixed = fixed_part(renderer, messages, tools, window, None, "messages")
        policy = with_defaults(None, default_policy(window, fixed, cfg.clear_at, cfg.clear_to, cfg.compact_at))
        p = ctx.prepare(owner, SessionRef(session), messages, tools, policy, window, want_ids=True)
        ids = p.prompt_ids
        floor_ids = renderer.render(messages, tools).token_ids
        rows.append(TurnCost(t, len(ids), len(ids) - common_prefix(prev, ids), len(floor_ids),
                             len(floor_ids) - common_prefix(prev_floor, floor_ids),
                             [e["type"] for e in p.report["applied_edits"]]))
        prev, prev_floor = ids, floor_ids
    return rows


def totals(rows: list[TurnCost]) -> dict:
    computed, floor = sum(r.computed for r in rows), sum(r.floor for r in rows)
    edited = [r.turn for r in rows if r.edits]
    return {"turns": len(rows), "computed": computed, "floor": floor,
            "ratio": round(computed / floor, 4) if floor else None, "edit_turns": edited,
            "max_prompt": max((r.prompt_tokens for r in rows), default=0)}
