"""KV reuse after clearing: plans what the connector (agentkv.kernels.connector) should move.

Per session the front remembers the key and token ids of the last prompt the engine saved. When
clearing edits a prompt, the kept tokens come from that saved prompt, shifted to their new
positions; the replacement (placeholder) tokens are computed by a short priming request — the
shared prefix plus all placeholders back to back — whose K/V the connector saves and shifts into
place as well. At layer 0 this is exact; deeper layers see the placeholders' K/V computed without
the kept tokens in between (the approximation `blend` trades back by recomputing a tail).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from ..kernels.connector import prompt_hash
from ..kernels.plan import Span, build_plan
from .metrics import KV_PLANNED, KV_PRIMED

Mode = Literal["recompute", "shift", "blend"]
MAX_SESSIONS = 4096
CONNECTOR = {"kv_connector": "AgentKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "agentkv.kernels.connector"}


def new_key() -> str:
    return uuid.uuid4().hex


@dataclass
class ReusePlan:
    prime_ids: list[int] | None
    prime_key: str | None
    load: dict | None
    planned_tokens: int


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plan_reuse(src_key: str, src_ids: list[int], old_ids: list[int], new_ids: list[int], edits: list,
               mode: Mode, blend_fraction: float) -> ReusePlan:
    """Runs for the connector: kept tokens of ``old_ids`` (the prompt before clearing) that the
    saved ``src_ids`` holds, and the placeholders from a priming prompt."""
    usable = common_prefix(src_ids, old_ids)
    spans = [Span(e.start, e.end, len(e.replacement_ids)) for e in sorted(edits, key=lambda e: e.start)]
    if not spans or usable <= spans[0].start:
        return ReusePlan(None, None, None, 0)
    import torch

    table = torch.arange(len(old_ids) + len(new_ids) + 1)
    plan = build_plan(len(old_ids), spans, table, table, 1, skip_unmoved=False)
    runs, planned = [], 0
    kept, new = plan.kept_positions.tolist(), plan.new_positions.tolist()
    i = 0
    while i < len(kept) and kept[i] < usable:  # contiguous runs of equal delta
        j = i
        while j + 1 < len(kept) and kept[j + 1] == kept[j] + 1 and kept[j + 1] < usable:
            j += 1
        runs.append([src_key, kept[i], kept[j] + 1, new[i]])
        planned += kept[j] + 1 - kept[i] if new[i] != kept[i] else 0
        i = j + 1
    first = plan.replacement_positions.tolist()[:1]
    prime_ids = prime_key = None
    if first:
        reps = [tok for e in sorted(edits, key=lambda e: e.start) for tok in e.replacement_ids]
        prime_ids, prime_key = new_ids[:first[0]] + reps, new_key()
        offset = first[0]
        for pos_run in _runs_of(plan.replacement_positions.tolist()):
            runs.append([prime_key, offset, offset + len(pos_run), pos_run[0]])
            offset += len(pos_run)
    covered = max(r[3] + r[2] - r[1] for r in runs)
    tail = int(blend_fraction * max(0, covered - spans[0].start)) if mode == "blend" else 0
    load = {"hash": prompt_hash(new_ids), "runs": runs, "recompute_tail": tail}
    return ReusePlan(prime_ids, prime_key, load, max(0, planned - tail))


def _runs_of(positions: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][-1] + 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


async def attach(state, engine, body: dict, session: str, prepared, mode: Mode) -> None:
    """Ask the connector to save this prompt, and (after clearing) to load what can be moved; run
    the priming request first. Records the plan in the context-management report."""
    last: dict = state.kv_last
    save = new_key()
    params: dict = {"save": save}
    if mode != "recompute" and prepared.edits and session in last:
        src_key, src_ids = last[session]
        plan = plan_reuse(src_key, src_ids, prepared.old_ids, prepared.prompt_ids, prepared.edits, mode,
                          state.cfg.blend_fraction)
        if plan.prime_ids:
            prime = {"model": state.cfg.model_name, "prompt": plan.prime_ids, "max_tokens": 1,
                     "kv_transfer_params": {"agentkv": {"save": plan.prime_key}}}
            if body.get("cache_salt"):  # the main request must find the primed blocks
                prime["cache_salt"] = body["cache_salt"]
            status, _ = await engine.post_json("/v1/completions", prime)
            if status != 200:
                plan.load = None
        if plan.load:
            params["load"] = plan.load
        KV_PLANNED.labels(mode).inc(plan.planned_tokens if plan.load else 0)
        KV_PRIMED.inc(len(plan.prime_ids or []))
        for edit in prepared.report["applied_edits"]:
            if edit["type"].startswith("clear_tool_uses"):  # agentkv's name or Anthropic's
                edit["kv"] = {"mode": mode, "planned_reuse_tokens": plan.planned_tokens if plan.load else 0,
                              "primed_tokens": len(plan.prime_ids or [])}
    body["kv_transfer_params"] = {"agentkv": params}
    last.pop(session, None)
    last[session] = (save, prepared.prompt_ids)
    while len(last) > MAX_SESSIONS:       # oldest sessions first (dicts keep insertion order)
        last.pop(next(iter(last)))
