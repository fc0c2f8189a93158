"""The front's own cost: prompt work per request against conversation length, and the streaming
relay against the same engine reached directly.

1. **Prompt work** (in process, no engine): a tool-heavy agent conversation (coding-agent system
   prompt and tools, file reads, command outputs, greps) grown to 10k..200k tokens of the served
   tokenizer (SmolLM2's by default), then requests that each add one turn (the model's tool call
   and its result). Per request: the context step (``ContextManager.prepare``: session log sync in
   SQLite, view, the default policy's checks, counts, and the prompt's token ids as KV reuse asks
   for them) with the renderer's segments and with whole renders, both on vLLM's own render of the
   conversation (``server.render.engine_chat``), plus the request body's own path (JSON,
   validation, the body sent on), and the ids sent to vLLM (``EngineChat.prompt_ids``: vLLM's chat
   preprocessing with the template rendered whole, tokenized incrementally) against vLLM's own
   chat preprocessing of the same request (its ``OnlineRenderer``, which tokenizes the whole
   prompt: what vLLM does per request when it is sent messages). Also at the largest size: one new
   message of 100..10k tokens, so the time is seen growing with what is new.
2. **Relay** (a real engine, one server per ``--models``: SmolLM2, whose decode is bound by the
   model as on an accelerator, and the 2-layer tiny model, whose decode is bound by vLLM's own
   Python, the front's worst case): streamed chat completions decoding ``--tokens`` tokens each
   (``ignore_eos``), ``--concurrency`` at a time, each a new conversation, through agentkv and
   straight to its vLLM (its Unix socket and secret read from the engine process the server
   started, or ``--engine-url`` (``http://...`` or ``unix:PATH``) and ``--engine-key``), interleaved
   A B B A over ``--rounds`` (more at low concurrency: at least ``--ttft-samples`` requests per
   target): aggregate decode tokens/s (all streams' tokens after their first, over the time from the
   first first token to the last token; median over rounds), end-to-end tokens/s (all tokens over
   the batch's wall time, TTFT included), TTFT p50 (all requests), how much later a first token
   comes through agentkv (the k-th of a burst against the k-th of the adjacent direct burst:
   ``rank_difference``), 95% intervals of the decode ratio and of that TTFT difference (rounds
   resampled: a round's streams share one burst, they are not independent samples), so a
   difference the machine cannot resolve reads "unresolved", not met or missed; and, when the
   benchmark started the server, the CPU time per streamed event of each process (the front, vLLM's
   API server, its engine core and workers): the front's own cost, which the machine's noise does
   not blur the way it blurs wall times.

Usage: ``agentkv bench front [--quick] [--url URL --api-key KEY --engine-url URL --engine-key KEY]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from agentkv.server import timing
from agentkv.server.embedded_model.names import SMOLLM2, TINY

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results

SYSTEM = ("You are a coding agent working in a large Python repository. Read before you edit, run the tests "
          "after every change, keep diffs small, and report what you changed and why. ") * 12
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {k: {"type": "string", "description": k} for k in args}, "required": args[:1]}}}
    for name, desc, args in [("read_file", "Read a file of the repository", ["path", "start", "end"]),
                             ("bash", "Run a shell command in the repository", ["command", "timeout"]),
                             ("grep", "Search the repository for a pattern", ["pattern", "path"]),
                             ("write_file", "Write a file of the repository", ["path", "content"]),
                             ("list_dir", "List a directory", ["path"]),
                             ("run_tests", "Run the test suite or one test", ["target"])]]
WORDS = ("self config value request session engine token prompt cache index result error retry queue "
         "shard node disk write read commit return import def class if else for while with yield").split()


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        indent = "    " * rng.randrange(3)
        out.append(f"{i + 1:5d}  {indent}{rng.choice(WORDS)}_{rng.choice(WORDS)} = "
                   f"{rng.choice(WORDS)}({rng.choice(WORDS)}, {rng.randrange(1000)})")
    return "\n".join(out)


def _output(rng: random.Random, lines: int) -> str:
    return "\n".join(f"{rng.choice(['PASSED', 'FAILED', 'ok', 'warn'])} tests/test_{rng.choice(WORDS)}.py::"
                     f"test_{rng.choice(WORDS)}_{rng.choice(WORDS)} [{rng.randrange(100)}%] {rng.random():.3f}s"
                     for _ in range(lines))


def turn(rng: random.Random, n: int, lines: int | None = None) -> list[dict]:
    """One agent step: a tool call and its result (a file read, a command's output or a grep)."""
    kind = rng.choice(["read_file", "bash", "grep"])
    if lines is None:  # mostly short outputs, some pages, a few whole files
        lines = rng.choices([rng.randrange(2, 12), rng.randrange(15, 40), rng.randrange(80, 200)], [70, 25, 5])[0]
    args = {"read_file": {"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py"},
            "bash": {"command": f"pytest -q tests/test_{rng.choice(WORDS)}.py"},
            "grep": {"pattern": rng.choice(WORDS), "path": "src"}}[kind]
    result = _code(rng, lines) if kind != "bash" else _output(rng, lines)
    call = {"id": f"call_{n}", "type": "function", "function": {"name": kind, "arguments": json.dumps(args)}}
    content = rng.choice([None, None, f"Let me look at {args.get('path') or args.get('pattern') or 'the tests'}."])
    return [{"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result}]


def conversation(renderer, tokens: int, seed: int = 0) -> list[dict]:
    """A tool-heavy agent conversation of about ``tokens`` prompt tokens (a user follow-up every
    eight steps)."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "The session tests fail after the last refactor; find out why and fix it."}]
    n = 0
    while renderer.count(msgs, TOOLS) < tokens:
        n += 1
        msgs += turn(rng, n)
        if n % 8 == 0:
            msgs += [{"role": "assistant", "content": "The failure comes from the cache layer; checking its callers."},
                     {"role": "user", "content": f"Also check {rng.choice(WORDS)}.py while you are there."}]
    return msgs


# -- 1. prompt work ------------------------------------------------------------------------------
WINDOW = 1 << 22  # the default policy for a window no conversation here reaches: no edit fires (the steady state)


def _context_step(renderer, window: int):
    from agentkv.compaction.log.open import open_session_log
    from agentkv.compaction.policy import default_policy
    from agentkv.server.pipeline.context import ContextManager
    from agentkv.server.pipeline.sessions import Sessions

    log = open_session_log(Path(tempfile.mkdtemp(prefix="agentkv-front-")) / "log.db")
    from agentkv.server.config import ServeConfig

    d = ServeConfig()
    return ContextManager(Sessions(log), renderer, None), default_policy(window, 0, d.clear_at, d.clear_to,
                                                                         d.compact_at), log


def _body_path(raw: bytes) -> None:
    """What the edge and the chat route do with the body before the context step, and the body it
    sends on."""
    import msgspec

    from agentkv.server.api.chat.protocol import ChatCompletionRequest, forward_body
    from agentkv.server.engine.client import encode_json

    req = ChatCompletionRequest.model_validate(msgspec.json.decode(raw))
    body = forward_body(req, "model")
    encode_json(body)


def ids_rows(chat, size: int, tokens: int, grown: list[list[dict]]) -> list[dict]:
    """The ids sent to vLLM for each grown request: the front's (``chat.prompt_ids``, one slot for
    the conversation: each request tokenizes what is new) and vLLM's own chat preprocessing of the
    same request (whole tokenization), interleaved request by request; equal ids asserted."""
    import copy

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.hf import HfRenderer

    ref = copy.copy(chat.online)
    ref.renderer = HfRenderer(chat.renderer.config, chat.base_tokenizer)
    out = {"front": ([], []), "vllm": ([], [])}

    async def run():
        for msgs in grown:
            body = {"model": "m", "messages": msgs, "tools": TOOLS}
            t0, c0 = time.perf_counter(), time.process_time()
            mine = await chat.prompt_ids(body, ("bench", size))
            out["front"][0].append(time.perf_counter() - t0)
            out["front"][1].append(time.process_time() - c0)
            t0, c0 = time.perf_counter(), time.process_time()
            theirs = (await ref.render_chat(ChatCompletionRequest.model_validate(copy.deepcopy(body))))[1][0]
            out["vllm"][0].append(time.perf_counter() - t0)
            out["vllm"][1].append(time.process_time() - c0)
            if mine != theirs["prompt_token_ids"]:
                raise RuntimeError("the front's ids differ from vLLM's render")
    asyncio.run(run())
    return [{"part": "ids", "mode": {"front": "front ids (incremental)", "vllm": "vLLM chat render"}[k],
             "tokens": tokens, "messages": len(grown[0]), "cold_ms": t[0] * 1e3,
             "per_request_ms": statistics.median(t[1:]) * 1e3, "per_request_cpu_ms": statistics.median(c[1:]) * 1e3,
             "per_request_ms_all": [round(x * 1e3, 3) for x in t[1:]]} for k, (t, c) in out.items()]


def prompt_rows(renderer_of, bases: dict[int, list[dict]], turns: int, new_sizes: list[int],
                chat=None) -> list[dict]:
    """Per conversation (``bases``: by the size asked for) and mode: the first request (cold) and
    ``turns`` requests adding one turn each; with ``chat`` (vLLM's render), the ids sent too."""
    from agentkv.server.pipeline.sessions import SessionRef

    rows = []
    counter = renderer_of(True)
    for size, base in bases.items():
        tokens = counter.count(base, TOOLS)
        rng = random.Random(size)
        grown = [base]
        for t in range(turns):
            grown.append(grown[-1] + turn(rng, 10_000 + t))
        for mode in ("segments", "whole"):
            ctx, policy, log = _context_step(renderer_of(mode == "segments"), window=WINDOW)
            times, cpu = [], []
            for msgs in grown:
                t0, c0 = time.perf_counter(), time.process_time()
                p = ctx.prepare("bench", SessionRef(f"s{size}"), msgs, TOOLS, policy, want_ids=True)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if p.report["applied_edits"] or len(p.prompt_ids) != p.report["prompt_tokens_after"]:
                    raise RuntimeError(f"not the steady state measured here: {p.report}")
            log.close()
            new = [counter.count(b, TOOLS) - counter.count(a, TOOLS) for a, b in zip(grown, grown[1:])]
            rows.append({"part": "prompt", "mode": mode, "tokens": tokens, "messages": len(base),
                         "cold_ms": times[0] * 1e3, "per_request_ms": statistics.median(times[1:]) * 1e3,
                         "per_request_cpu_ms": statistics.median(cpu[1:]) * 1e3,
                         "per_request_ms_all": [round(t * 1e3, 3) for t in times[1:]],
                         "new_tokens_per_request": statistics.median(new)})
        raws = [json.dumps({"model": "m", "messages": m, "tools": TOOLS, "stream": True}).encode() for m in grown[1:]]
        times, cpu = [], []
        for raw in raws:
            t0, c0 = time.perf_counter(), time.process_time()
            _body_path(raw)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        rows.append({"part": "body", "mode": "request body", "tokens": tokens, "messages": len(base),
                     "bytes": len(raws[-1]), "per_request_ms": statistics.median(times) * 1e3,
                     "per_request_cpu_ms": statistics.median(cpu) * 1e3})
        if chat is not None:
            rows += ids_rows(chat, size, tokens, grown)
    if new_sizes:  # the largest conversation, one new message of each size
        base = list(bases.values())[-1]
        ctx, policy, log = _context_step(renderer_of(True), window=WINDOW)
        ctx.prepare("bench", SessionRef("grow"), base, TOOLS, policy, want_ids=True)
        msgs, rng = base, random.Random(1)
        for n, lines in enumerate(new_sizes):
            step = turn(rng, 20_000 + n, lines=lines)
            msgs = msgs + step
            new = counter.count(msgs, TOOLS) - counter.count(msgs[:-1], TOOLS)
            t0, c0 = time.perf_counter(), time.process_time()
            ctx.prepare("bench", SessionRef("grow"), msgs, TOOLS, policy, want_ids=True)
            rows.append({"part": "new", "mode": "segments", "tokens": counter.count(msgs, TOOLS),
                         "new_tokens": new, "per_request_ms": (time.perf_counter() - t0) * 1e3,
                         "per_request_cpu_ms": (time.process_time() - c0) * 1e3})
        log.close()
    return rows


# -- 2. relay ------------------------------------------------------------------------------------
# decoded tokens a request, per model: agentkv-tiny decodes a 64-token stream in ~150 ms, less than
# one stall of a client (or API server) that shares its core, and a stall read at once as a burst
# is then most of the stream; 512 tokens keep the stream seconds long (on two shared cores whole
# streams still arrived at their end in some rounds: README, "front")
TOKENS = {SMOLLM2: 64, TINY: 512}


def engine_of(pid: int) -> tuple[str, str]:
    """(address, secret) of the vLLM engine under the agentkv server process ``pid``: its Unix socket
    from the engine's argv (``unix:PATH``), its secret from its environment (``VLLM_API_KEY``;
    readable by the same user)."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        try:
            argv, env = child.cmdline(), child.environ()
        except psutil.Error:
            continue
        if "VLLM_API_KEY" in env and "--uds" in argv and "vllm.entrypoints.openai.api_server" in argv:
            return f"unix:{argv[argv.index('--uds') + 1]}", env["VLLM_API_KEY"]
    raise RuntimeError(f"no vLLM engine under process {pid}")


def processes(pid: int) -> dict[str, list]:
    """The agentkv server ``pid``'s processes by role: the front, vLLM's API server, its engine
    core and its model workers (psutil processes)."""
    import psutil

    front = psutil.Process(pid)
    roles: dict[str, list] = {"front": [front], "vllm api server": [], "engine core": [], "worker": []}
    for child in front.children(recursive=True):
        try:
            name, argv = child.name(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        role = ("vllm api server" if "vllm.entrypoints.openai.api_server" in argv else
                "engine core" if name.startswith("VLLM::EngineCor") else
                "worker" if name.startswith("VLLM::Worker") else None)
        if role:
            roles[role].append(child)
    return roles


def cpu_seconds(roles: dict[str, list]) -> dict[str, float]:
    """User + system CPU seconds used so far by each role's processes (all their threads)."""
    return {role: sum(sum(p.cpu_times()[:2]) for p in procs) for role, procs in roles.items()}


def _session(target: str, key: str | None):
    """An aiohttp session for ``http://host:port`` or ``unix:PATH`` (the engine's socket), and its URL."""
    import aiohttp

    from agentkv.server.engine.client import ENGINE_URL

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if target.startswith("unix:"):
        connector, url = aiohttp.UnixConnector(path=target[5:], limit=0), ENGINE_URL
    else:
        connector, url = aiohttp.TCPConnector(limit=0), target
    return aiohttp.ClientSession(connector=connector, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=600)), url


async def _one(session, url: str, model: str, tokens: int, rng: random.Random) -> dict:
    """One streamed request; the time of every event that carries content, the usage's token count."""
    words = " ".join(rng.choice(WORDS) for _ in range(24))
    body = {"model": model, "messages": [{"role": "system", "content": f"Agent {uuid.uuid4().hex}."},
                                         {"role": "user", "content": f"Continue: {words}"}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    usage, events = None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
        spans = timing.parse(r.headers.get("Server-Timing", ""))   # agentkv's own account (none from vLLM)
        async for line in r.content:   # SSE lines (the client's own cost kept small: it shares the CPU)
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            events += 1
            if b'"usage":{' in line:
                usage = json.loads(line[5:])["usage"]
            if b'"content":"' in line:
                last = time.perf_counter()
                first = first or last
    if usage is None or first is None:
        raise RuntimeError("a stream ended without tokens or usage")
    return {"ttft_s": first - t0, "tokens": usage["completion_tokens"], "first": first, "end": last, "events": events,
            "spans": spans}


async def _batch(target: str, key: str | None, model: str, concurrency: int, tokens: int, seed: int) -> dict:
    session, url = _session(target, key)
    async with session:
        rng = random.Random(seed)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_one(session, url, model, tokens, rng) for _ in range(concurrency)))
    wall = max(r["end"] for r in res) - t0
    # decode: every stream's tokens after its first, over the time from the first first token to the
    # last token (a relay that holds tokens back and sends them in bursts does not look faster)
    decode = sum(r["tokens"] - 1 for r in res) / (max(r["end"] for r in res) - min(r["first"] for r in res))
    return {"tok_s": decode, "e2e_tok_s": sum(r["tokens"] for r in res) / wall, "ttft": [r["ttft_s"] for r in res],
            "events": sum(r["events"] for r in res), "spans": [r["spans"] for r in res]}


def rounds_at(concurrency: int, rounds: int, samples: int) -> int:
    """A/B rounds at ``concurrency`` streams: at least ``rounds``, and enough for ``samples``
    requests (TTFTs) per target."""
    return max(rounds, math.ceil(samples / concurrency))


def relay_rows(front: tuple[str, str | None], engine: tuple[str, str], model: str, levels: list[int],
               tokens: int, rounds: int, progress, roles: dict[str, list] | None = None,
               samples: int = 0) -> list[dict]:
    """A/B rounds at each concurrency (``rounds_at``); with ``roles`` (the server's processes) also
    the CPU each role used per streamed event, through agentkv and direct."""
    targets = {"agentkv": front, "engine": engine}
    asyncio.run(_batch(*front, model, 2, 4, seed=0))  # warm both paths
    asyncio.run(_batch(*engine, model, 2, 4, seed=0))
    rows = []
    for c in levels:
        got: dict[str, list[dict]] = {"agentkv": [], "engine": []}
        for r in range(rounds_at(c, rounds, samples)):
            for name in (("agentkv", "engine") if r % 2 == 0 else ("engine", "agentkv")):
                before = cpu_seconds(roles) if roles else {}
                batch = asyncio.run(_batch(*targets[name], model, c, tokens, seed=1000 * c + r))
                if roles:
                    after = cpu_seconds(roles)
                    batch["cpu_s"] = {k: after[k] - before[k] for k in after}
                got[name].append(batch)
                progress()
        for name, batches in got.items():
            ttft = [t for b in batches for t in b["ttft"]]
            row = {"part": "relay", "target": name, "concurrency": c, "tokens_per_request": tokens,
                   "decode_tok_s": statistics.median(b["tok_s"] for b in batches),
                   "decode_tok_s_rounds": [round(b["tok_s"], 1) for b in batches],
                   "e2e_tok_s": statistics.median(b["e2e_tok_s"] for b in batches),
                   "e2e_tok_s_rounds": [round(b["e2e_tok_s"], 1) for b in batches],
                   "ttft_p50_ms": statistics.median(ttft) * 1e3,
                   "ttft_p90_ms": sorted(ttft)[int(0.9 * (len(ttft) - 1))] * 1e3,
                   "ttft_ms_rounds": [[round(t * 1e3, 2) for t in b["ttft"]] for b in batches],
                   "events": sum(b["events"] for b in batches)}
            for span in ("front", "context"):   # agentkv's Server-Timing: its time before the engine's
                ms = sorted(x[span] for b in batches for x in b["spans"] if span in x)
                if ms:
                    row[f"{span}_ms_p50"], row[f"{span}_ms_p90"] = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
            if roles:   # CPU microseconds per streamed event, all rounds together
                row["cpu_us_per_event"] = {k: 1e6 * sum(b["cpu_s"][k] for b in batches) / row["events"]
                                           for k in batches[0]["cpu_s"]}
            rows.append(row)
    return rows


def resampled_interval(a: list, b: list, stat, reps: int = 2000, seed: int = 0,
                       paired: bool = False) -> tuple[float, float]:
    """95% interval of ``stat(a, b)`` with the rounds of ``a`` and ``b`` resampled (with
    replacement): a round is the unit, its streams shared one burst and its prefill batches.
    ``paired``: round i of ``a`` goes with round i of ``b`` (adjacent in time), resampled together."""
    rng = random.Random(seed)

    def draw() -> tuple[list, list]:
        if not paired:
            return rng.choices(a, k=len(a)), rng.choices(b, k=len(b))
        picks = rng.choices(range(len(a)), k=len(a))
        return [a[i] for i in picks], [b[i] for i in picks]

    values = sorted(stat(*draw()) for _ in range(reps))
    return values[int(0.025 * reps)], values[math.ceil(0.975 * reps) - 1]


def rank_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """How much later a stream's first token comes through agentkv: the median, over paired rounds
    (round i of each target, adjacent in time) and over ranks, of the k-th first token of ``a``'s
    burst minus the k-th of ``b``'s. Not the difference of two p50s: where prefills take turns, a
    burst's TTFTs fall in modes (at 2 streams: one prefill step, two), half of all samples in each,
    and their p50 lands in the empty gap between, where one slow round moves it by tens of ms."""
    return statistics.median(x - y for ra, rb in zip(a, b) for x, y in zip(sorted(ra), sorted(rb)))


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


TTFT_GOAL_MS, DECODE_GOAL = 5.0, 0.95


def verdict(decode: tuple[float, float], ttft: tuple[float, float]) -> str:
    """"met", "missed" or "unresolved" from the 95% intervals of the decode ratio (goal: at least
    0.95) and of the TTFT difference (``rank_difference``; goal: at most 5 ms): met when both
    intervals are inside their goals, missed when either lies wholly outside, unresolved otherwise."""
    if decode[1] < DECODE_GOAL or ttft[0] > TTFT_GOAL_MS:
        return "missed"
    return "met" if decode[0] >= DECODE_GOAL and ttft[1] <= TTFT_GOAL_MS else "unresolved"


def relay_summary(rows: list[dict]) -> list[dict]:
    """agentkv against the engine, per model and concurrency: throughput ratios, TTFT difference and
    (where measured) the front's CPU per streamed event beside vLLM's own API server's."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for c in sorted({r["concurrency"] for r in rows if r["model"] == model}):
            a, e = (next(r for r in rows if r["model"] == model and r["concurrency"] == c and r["target"] == t)
                    for t in ("agentkv", "engine"))
            row = {"model": model, "concurrency": c, "agentkv_tok_s": a["decode_tok_s"],
                   "engine_tok_s": e["decode_tok_s"], "throughput_ratio": a["decode_tok_s"] / e["decode_tok_s"],
                   "e2e_ratio": a["e2e_tok_s"] / e["e2e_tok_s"],
                   "agentkv_ttft_p50_ms": a["ttft_p50_ms"], "engine_ttft_p50_ms": e["ttft_p50_ms"],
                   "ttft_p50_extra_ms": a["ttft_p50_ms"] - e["ttft_p50_ms"],
                   "throughput_ratio_interval": resampled_interval(a["decode_tok_s_rounds"], e["decode_tok_s_rounds"],
                                                                   median_ratio),
                   "ttft_extra_ms": rank_difference(a["ttft_ms_rounds"], e["ttft_ms_rounds"]),
                   "ttft_extra_interval_ms": resampled_interval(a["ttft_ms_rounds"], e["ttft_ms_rounds"],
                                                                rank_difference, paired=True),
                   "rounds": len(a["ttft_ms_rounds"])}
            row["goal"] = verdict(row["throughput_ratio_interval"], row["ttft_extra_interval_ms"])
            if "front_ms_p50" in a:
                row["front_ms_p50"], row["front_ms_p90"] = a["front_ms_p50"], a["front_ms_p90"]
            if "cpu_us_per_event" in a:
                row["front_cpu_us_per_event"] = a["cpu_us_per_event"]["front"]
                row["vllm_api_cpu_us_per_event"] = e["cpu_us_per_event"]["vllm api server"]
            out.append(row)
    return out


def extra_ms(s: dict) -> str:
    """How much later a first token comes through agentkv (``rank_difference``), with its 95%
    interval: ``+3.1 [+1.2, +4.4]``."""
    lo, hi = s["ttft_extra_interval_ms"]
    return f"{s['ttft_extra_ms']:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def ratio(s: dict) -> str:
    """The decode ratio with its 95% interval: ``0.99 [0.97, 1.01]``."""
    lo, hi = s["throughput_ratio_interval"]
    return f"{s['throughput_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"


# -- 3. the engine's own prompt work -------------------------------------------------------------
async def _tokenize(target: str, key: str | None, model: str, msgs: list[dict], reps: int) -> tuple[list[float], int]:
    session, url = _session(target, key)
    times, body = [], {}
    async with session:
        for _ in range(reps):
            t0 = time.perf_counter()
            async with session.post(f"{url}/tokenize", json={"model": model, "messages": msgs, "tools": TOOLS,
                                                             "add_generation_prompt": True}) as r:
                if r.status != 200:
                    raise RuntimeError(f"/tokenize: HTTP {r.status}: {(await r.read())[:300]!r}")
                body = await r.json()
            times.append(time.perf_counter() - t0)
    return times, body["count"]


def engine_render_rows(engine: tuple[str, str], model: str, conversations: list[tuple[int, list[dict]]],
                       reps: int = 5) -> list[dict]:
    """What vLLM's own API server does with every chat request's prompt before its engine sees it:
    the whole chat template rendered and tokenized (its ``/tokenize`` route, which runs the same
    preprocessing as its chat route, and nothing else), at the prompt part's conversation sizes
    (``tokens``: the served tokenizer's count, ``engine_tokens``: the engine's). The front sends
    vLLM messages, so a request through agentkv pays this on top of the front's own prompt work."""
    rows = []
    for tokens, msgs in conversations:
        times, count = asyncio.run(_tokenize(*engine, model, msgs, reps))
        rows.append({"part": "engine", "model": model, "tokens": tokens, "engine_tokens": count,
                     "per_request_ms": statistics.median(times) * 1e3,
                     "per_request_ms_all": [round(t * 1e3, 3) for t in times]})
    return rows


def plot(prompt: list[dict], engine_render: list[dict], summary: list[dict], relay: list[dict], title: str):
    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.2))
    for mode, style in (("segments", "o-"), ("whole", "s--"), ("request body", "^:"),
                        ("front ids (incremental)", "v-"), ("vLLM chat render", "x--")):
        rs = [r for r in prompt if r["mode"] == mode and r["part"] != "new"]
        if rs:
            a.plot([r["tokens"] for r in rs], [r["per_request_ms"] for r in rs], style,
                   label={"segments": "context step, segments", "whole": "context step, whole render",
                          "request body": "request body (JSON, validation, sent on)",
                          "front ids (incremental)": "ids sent to vLLM (vLLM's render, tokenized incrementally)",
                          "vLLM chat render": "vLLM's chat render, whole tokenization (in process)"}[mode])
    for model in dict.fromkeys(r["model"] for r in engine_render):
        rs = [r for r in engine_render if r["model"] == model]
        a.plot([r["tokens"] for r in rs], [r["per_request_ms"] for r in rs], "d-.",
               label=f"vLLM's own render + tokenize ({model})")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("conversation tokens (one new turn a request)")
    a.set_ylabel("prompt work per request (ms)")
    a.set_ylim(bottom=0.02)   # the legend's room, below every line
    a.legend(fontsize=7, loc="lower right")
    for model in dict.fromkeys(r["model"] for r in relay):
        for name, style in (("agentkv", "o-"), ("engine", "s--")):
            rs = [r for r in relay if r["target"] == name and r["model"] == model]
            b.plot([r["concurrency"] for r in rs], [r["decode_tok_s"] for r in rs], style, label=f"{model}: {name}")
            c.plot([r["concurrency"] for r in rs], [r["ttft_p50_ms"] for r in rs], style, label=f"{model}: {name}")
    for ax, label in ((b, "aggregate decode tokens/s"), (c, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")   # two models, two orders of magnitude apart
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench front", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, concurrency 1 and 4 (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 25_000, 50_000, 100_000, 200_000],
                    help="conversation lengths in tokens (prompt part)")
    ap.add_argument("--turns", type=int, default=8, help="requests per size after the first (prompt part)")
    ap.add_argument("--new-sizes", type=int, nargs="*", default=[4, 40, 400],
                    help="lines of one new tool result at the largest size (prompt part)")
    ap.add_argument("--tokenizer", help="tokenizer + chat template folder (default: the embedded SmolLM2)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--tokens", type=int, help="decoded tokens per request (relay part; default: per model, "
                    + ", ".join(f"{m} {n}" for m, n in TOKENS.items()) + ")")
    ap.add_argument("--rounds", type=int, default=4, help="A/B rounds per concurrency, at least (relay part)")
    ap.add_argument("--ttft-samples", type=int, default=32,
                    help="requests per target at each concurrency, at least: more rounds where streams are few")
    ap.add_argument("--models", nargs="+", default=[SMOLLM2, TINY],
                    help="served models, one server each, when the benchmark starts the server (relay part)")
    ap.add_argument("--engine-url", help="the engine behind --url (default: read from the server started here)")
    ap.add_argument("--engine-key", help="its secret")
    ap.add_argument("--parts", nargs="+", choices=["prompt", "relay"], default=["prompt", "relay"],
                    help="which parts to run (prompt needs no engine)")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.turns, args.new_sizes = [2_000, 8_000], 3, [4, 40]
        args.concurrency, args.tokens, args.rounds, args.ttft_samples, args.models = [1, 4], 8, 2, 0, [TINY]
    if args.url and "relay" in args.parts and not (args.engine_url and args.engine_key):
        ap.error("--url needs --engine-url and --engine-key (the engine that server runs on)")
    from tqdm import tqdm

    from agentkv.compaction.prompt import PromptRenderer
    from agentkv.server.embedded_model.catalog import model_dir
    from agentkv.server.render.engine_chat import counting_renderer, for_model

    path = args.tokenizer or str(model_dir(SMOLLM2))
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")   # rendering only: conversations past its window
    chat = for_model(path, "--max-model-len", str(max(args.sizes) * 2), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes")
    segmented = counting_renderer(chat)

    def renderer(segments: bool) -> PromptRenderer:
        """The server's counting renderer (vLLM's render): by segments, or every request whole."""
        return segmented.sibling() if segments else PromptRenderer(chat.base_tokenizer, segments=False,
                                                                   render_text=chat.chat_text)

    counter = renderer(True)
    bases = {size: conversation(counter, size) for size in args.sizes}   # built once, for both parts
    prompt = prompt_rows(renderer, bases, args.turns, args.new_sizes, chat) if "prompt" in args.parts else []
    relay, engine_render = [], []
    conversations = [(counter.count(c, TOOLS), c) for c in bases.values()] if "relay" in args.parts else []
    for served in ([None] if args.url else args.models) if "relay" in args.parts else []:
        with Endpoint(args.url, args.api_key, () if args.url else ("--model", served)) as ep:
            engine = (args.engine_url, args.engine_key) if args.url else engine_of(ep.proc.pid)
            model = ep.model()["id"]
            bar = tqdm(total=2 * sum(rounds_at(c, args.rounds, args.ttft_samples) for c in args.concurrency),
                       desc=f"relay A/B, {model}")
            tokens = args.tokens or TOKENS.get(served, TOKENS[SMOLLM2])
            rows = relay_rows((ep.url, ep.api_key), engine, model, args.concurrency, tokens, args.rounds,
                              bar.update, roles=None if args.url else processes(ep.proc.pid),
                              samples=args.ttft_samples)
            relay += [{"model": model, **r} for r in rows]
            bar.close()
            engine_render += engine_render_rows(engine, model, conversations)
    summary = relay_summary(relay) if relay else []
    m = machine()
    tok_name = Path(path).name
    models = list(dict.fromkeys(r["model"] for r in relay))
    result = {"machine": m, "tokenizer": tok_name, "models": models, "prompt": prompt, "engine_render": engine_render,
              "relay": relay, "relay_summary": summary}
    # a run of one part writes a file of its own: it never replaces the results of both
    name = "front" + ("" if len(args.parts) == 2 else f"-{args.parts[0]}") + ("-quick" if args.quick else "")
    fig = plot(prompt, engine_render, summary, relay,
               f"agentkv front: prompt work ({tok_name}) and relay ({', '.join(models)})\n{machine_line(m)}")
    jpath, ppath = write_results(name, result, fig, args.out)
    print_table(f"front time per request ({tok_name})",
                ["part", "mode", "tokens", "messages", "new tokens", "cold ms", "ms/request", "CPU ms/request"],
                [[r["part"], r["mode"], r["tokens"], r.get("messages", ""),
                  r.get("new_tokens", r.get("new_tokens_per_request", "")), r.get("cold_ms", ""), r["per_request_ms"],
                  r["per_request_cpu_ms"]] for r in prompt], machine_line(m))
    if engine_render:
        print_table("vLLM's own prompt work per chat request (its /tokenize: the chat template rendered and tokenized)",
                    ["model", "tokens", "engine tokens", "ms/request"],
                    [[r["model"], r["tokens"], r["engine_tokens"], r["per_request_ms"]] for r in engine_render],
                    machine_line(m))
    for model in models:
        tokens = next(r["tokens_per_request"] for r in relay if r["model"] == model)
        print_table(f"relay through agentkv vs the engine ({model}, {tokens} tokens a request)",
                    ["streams", "agentkv decode tok/s", "engine decode tok/s", "ratio [95%]", "end-to-end ratio",
                     "agentkv TTFT p50 ms", "engine TTFT p50 ms", "TTFT extra ms [95%]",
                     "front before engine ms p50 (p90)",
                     "front CPU us/event", "vLLM API CPU us/event", "goal"],
                    [[s["concurrency"], s["agentkv_tok_s"], s["engine_tok_s"], ratio(s), s["e2e_ratio"],
                      s["agentkv_ttft_p50_ms"], s["engine_ttft_p50_ms"], extra_ms(s),
                      f"{s['front_ms_p50']:.1f} ({s['front_ms_p90']:.1f})" if "front_ms_p50" in s else "",
                      s.get("front_cpu_us_per_event", ""),
                      s.get("vllm_api_cpu_us_per_event", ""), s["goal"]]
                     for s in summary if s["model"] == model], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
