"""Public Claude Code traces (kv-cache-tester, Apache-2.0) turned into conversations to replay.

A trace (``benchmarks/data/traces``, see its README) is a real, anonymized Claude Code
conversation: per request its input and output token counts, the 64-token block hashes of its
prompt (same hash, same content), the kind of new content (a tool result or text) and why the
answer stopped. Its prompt is tools, then system, then messages, so the first request's first
``tool_tokens / 64`` blocks are the tool definitions and the next ``system_tokens / 64`` the system
prompt; every later request repeats the previous one's blocks (its last, partial block rehashed
once full) and appends the previous answer and the new content.

``conversation`` gives every block hash fixed text (``words_per_block`` words drawn from the hash,
so the same hash is the same text across requests and a conversation's text is reproducible)
and writes the requests an Anthropic Messages client would have sent: the tool definitions, the
system prompt, then per request the previous answer (its output blocks as text, plus a
``tool_use`` when the new content is a tool result) and the new content (that ``tool_result``, or a
user text). A trace is followed while its prompt only grows; where its client rewrote the middle
(its own compaction), the conversation ends. ``words_per_block`` scales it: 16 words (about 16
tokens) per 64-token block replays a conversation at a quarter of its size.
"""

from __future__ import annotations

import json
import lzma
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "traces"
FIXTURE = DATA / "kv-cache-tester.json.xz"
BLOCK = 64

# words that are one token each (after a space) in the vocabularies of the served models: agentkv's
# test models (2,048 tokens) and SmolLM2 (49,152), so a block of N words is about N tokens
WORDS = ("the of and to in is for on that with as it be by this are from or at an not was have can file "
         "code test value error cache block token request session result tool server write read search "
         "run build function return self config model output user time call open make use new first "
         "next more all other some any only also then when where which what how if").split()


def block_text(trace_id: str, hash_id: int, words: int) -> str:
    rng = random.Random(f"{trace_id}:{hash_id}")
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _text(trace_id: str, ids: list[int], words: int) -> str:
    return " ".join(block_text(trace_id, h, words) for h in ids)


def append_only(requests: list[dict]) -> int:
    """How many requests from the first each extend the previous prompt (up to its last block)."""
    n = 1
    for a, b in zip(requests, requests[1:]):
        pa, pb = a["hash_ids"], b["hash_ids"]
        if len(pb) < len(pa) - 1 or pb[:len(pa) - 1] != pa[:len(pa) - 1]:
            break
        n += 1
    return n


def conversation(trace: dict, words_per_block: int = 16, max_turns: int | None = None) -> list[dict]:
    """The Anthropic Messages requests of ``trace`` (recorded-session shape: path, headers, body)."""
    tid, reqs = trace["id"], trace["requests"]
    reqs = reqs[:append_only(reqs)][:max_turns]
    first = reqs[0]["hash_ids"]
    n_tools = max(1, round(trace["tool_tokens"] / BLOCK))
    n_system = max(1, round(trace["system_tokens"] / BLOCK))
    tool_ids, system_ids, task_ids = first[:n_tools], first[n_tools:n_tools + n_system], first[n_tools + n_system:]
    per_tool = max(1, -(-len(tool_ids) // 8))
    tools = [{"name": f"tool_{i}", "description": _text(tid, tool_ids[j:j + per_tool], words_per_block),
              "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}
             for i, j in enumerate(range(0, len(tool_ids), per_tool))]
    system = _text(tid, system_ids, words_per_block)
    messages = [{"role": "user", "content": _text(tid, task_ids, words_per_block) or "Start."}]
    out = []
    for i, req in enumerate(reqs):
        if i:
            prev = reqs[i - 1]
            new = req["hash_ids"][len(prev["hash_ids"]):]
            n_out = min(max(1, round(prev["out"] / BLOCK)), max(0, len(new) - 1))
            answer, content = new[:n_out], new[n_out:]
            said = [{"type": "text", "text": _text(tid, answer, words_per_block) or "ok"}]
            if "tool_result" in (req.get("input_types") or []):
                call = f"toolu_{tid.replace('_', '')}_{i:04d}"
                said.append({"type": "tool_use", "id": call, "name": tools[i % len(tools)]["name"],
                             "input": {"arg": f"step {i}"}})
                user = [{"type": "tool_result", "tool_use_id": call,
                         "content": _text(tid, content, words_per_block) or "done"}]
            else:
                user = _text(tid, content, words_per_block) or "Go on."
            messages = messages + [{"role": "assistant", "content": said}, {"role": "user", "content": user}]
        body = {"model": trace["models"][0], "max_tokens": max(1, req["out"]), "tools": tools,
                "system": system, "messages": messages}
        out.append({"path": "/v1/messages", "headers": {"x-claude-code-session-id": tid}, "body": body})
    return out


def load(path: Path = FIXTURE) -> list[dict]:
    """The traces kept in the fixture (each as kv-cache-tester wrote it, cut to the requests used)."""
    return json.loads(lzma.decompress(Path(path).read_bytes()))["traces"]


def select(folder: Path, n: int, max_turns: int, min_turns: int = 20) -> list[dict]:
    """The first ``n`` traces of a kv-cache-tester ``traces/`` folder (by name) that start a
    conversation (their first prompt is the tools and system prompt and under 8,000 more tokens),
    have no subagents, grow by appending for ``min_turns`` requests or more and end above four times
    their fixed part; each cut to its first ``max_turns`` such requests. A trace starting as an
    earlier one did (the same conversation forked) is dropped."""
    chosen, seen = [], set()
    for path in sorted(Path(folder).glob("*.json")):
        t = json.loads(path.read_text())
        reqs = t["requests"]
        if any("hash_ids" not in r for r in reqs):     # a subagent's entry (it has its own requests)
            continue
        fixed = t["tool_tokens"] + t["system_tokens"]
        used = min(append_only(reqs), max_turns)
        sig = tuple(r["in"] for r in reqs[:5])       # the same conversation re-run (a fork)
        if used < min_turns or reqs[0]["in"] >= fixed + 8000 or reqs[used - 1]["in"] <= 4 * fixed or sig in seen:
            continue
        seen.add(sig)
        keep = ("t", "in", "out", "hash_ids", "input_types", "output_types", "stop", "think_time")
        chosen.append({**{k: v for k, v in t.items() if k not in ("requests", "totals")},
                       "requests": [{k: r[k] for k in keep if k in r} for r in reqs[:used]]})
        if len(chosen) == n:
            break
    return chosen


if __name__ == "__main__":   # python -m agentkv.benchmarks.traces KV_CACHE_TESTER/traces [N] [MAX_TURNS]
    import sys

    picked = select(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 24,
                    int(sys.argv[3]) if len(sys.argv) > 3 else 40)
    DATA.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_bytes(lzma.compress(json.dumps({"source": "github.com/callanjfox/kv-cache-tester traces/",
                                                  "traces": picked}).encode(), preset=9))
    print(f"wrote {len(picked)} traces to {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
