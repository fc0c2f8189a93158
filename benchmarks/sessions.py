"""Real agent sessions replayed: what each turn costs through agentkv (recompute, shift) and through
vLLM reached directly, against the floor.

A session is a real client's recorded requests (``benchmarks/data/sessions``: Claude Code, Codex,
opencode and pi doing real work in a source tree, see ``session_record``), sent again turn by turn, as recorded, to
each arm: ``vllm`` (vLLM's own API server, same model and window, no agentkv), ``recompute`` and
``shift`` (agentkv with its default policy and that KV mode), and ``floor`` (agentkv on a window the
session never fills, context management off: the prefix cache serves everything but the new
content, which is all a session must cost). Per turn: status, latency (one output token, so
about the TTFT), prompt tokens, tokens computed (prompt less the engine's cached tokens), and the
edits that fired; per arm: turns answered, tokens computed and their ratio to the floor, latency
p50/p99, the largest prompt held. ``--traces N`` replays N public Claude Code traces instead
(``traces``: kv-cache-tester's, given text). ``--copies K`` replays each session K times (each copy
its own session: its own id and a distinct first line, so copies share no cache) and
``--concurrent N`` runs N sessions at once, ``--think-s`` apart.
Every server it starts is stopped on every way out.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .harness import Endpoint, machine, machine_line, print_table, pyplot, start_logged, wait_ready, write_results
from .session_record import DATA, PACKAGES, load

ARMS = ("vllm", "recompute", "shift", "recompute-no-retention", "shift-no-retention", "shift-no-tier", "floor")
DEFAULT_ARMS = ("vllm", "recompute", "shift", "floor")   # the others: a part turned off, on demand
SERVE_ARGS = {"shift": ("--kv-reuse", "shift"), "recompute-no-retention": ("--no-kv-retention",),
              "shift-no-retention": ("--kv-reuse", "shift", "--no-kv-retention"),
              "shift-no-tier": ("--kv-reuse", "shift", "--kv-offload-gib", "0"),
              "floor": ("--no-context-management",)}
FLOOR_WINDOW = 262_144
POOL_BLOCK = 128          # tokens per KV block where --pool-tokens sets the pool (vLLM's CPU default)


def copy_of(request: dict, k: int, model: str, run: str) -> tuple[str, dict, dict]:
    """The request as copy ``k`` of its session sends it in ``run``: its own session id and a
    distinct first line (copies share no cache), the served model, one output token, not streamed."""
    body = copy.deepcopy(request["body"])
    headers = {h: v for h, v in request["headers"].items() if h.lower() != "x-claude-code-session-id"}
    tag = f"[session {k}] "
    body["model"], body["stream"] = model, False
    path = request["path"].split("?")[0]
    if path.endswith("/messages"):        # Anthropic Messages (Claude Code)
        body["max_tokens"] = 1
        body.pop("thinking", None)
        system = body.get("system")
        if isinstance(system, list) and system and system[0].get("type") == "text":
            system[0] = {**system[0], "text": tag + system[0]["text"]}
        elif isinstance(system, str):
            body["system"] = tag + system
        sid = (request["headers"].get("x-claude-code-session-id") or "s") + f"-{run}-{k}"
        headers["x-claude-code-session-id"] = sid
    elif path.endswith("/chat/completions"):      # Chat Completions (opencode, pi)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = 1
        body.pop("stream_options", None)
        first = body["messages"][0]
        if isinstance(first.get("content"), str):
            first["content"] = tag + first["content"]
        else:
            first["content"] = [{"type": "text", "text": tag}, *first["content"]]
        if "x-session-id" in {h.lower() for h in headers}:    # opencode names its session; pi does not
            headers = {h: (f"{v}-{run}-{k}" if h.lower() == "x-session-id" else v) for h, v in headers.items()}
    else:                          # Responses (Codex)
        body["max_output_tokens"] = 16   # the Responses API's smallest
        first = body["input"][0]
        part = first["content"][0]
        first["content"][0] = {**part, "text": tag + part["text"]}
        body["prompt_cache_key"] = f"{body.get('prompt_cache_key') or 's'}-{run}-{k}"
        body["store"] = False
    return path, headers, body


def usage_of(payload: dict) -> tuple[int, int]:
    """(prompt tokens, of which cached) from a Messages, Responses or Chat Completions answer."""
    u = payload.get("usage") or {}
    if "prompt_tokens" in u:                                              # Chat Completions
        return u["prompt_tokens"] or 0, (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if "input_tokens_details" in u or "output_tokens_details" in u:     # Responses
        return u.get("input_tokens") or 0, (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    cached = u.get("cache_read_input_tokens") or 0
    return (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0), cached


def replay(url: str, api_key: str | None, requests: list[dict], k: int, model: str, think_s: float,
           seed: int) -> list[dict]:
    """Copy ``k`` of a session sent turn by turn (a session id of its own in each call)."""
    import uuid

    import httpx

    rng = random.Random(seed * 1000 + k)
    run = uuid.uuid4().hex[:8]
    rows = []
    auth = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    with httpx.Client(base_url=url, timeout=1800, headers=auth) as http:
        for t, req in enumerate(requests):
            path, headers, body = copy_of(req, k, model, run)
            t0 = time.perf_counter()
            r = http.post(path, json=body, headers=headers)
            latency = time.perf_counter() - t0
            row = {"session": k, "turn": t, "status": r.status_code, "latency_s": round(latency, 4)}
            try:
                payload = r.json()
            except ValueError:
                payload = {}
            if r.status_code == 200:
                prompt, cached = usage_of(payload)
                cm = payload.get("context_management") or {}
                row.update(prompt_tokens=prompt, cached_tokens=cached, computed=prompt - cached,
                           edits=[e["type"] for e in cm.get("applied_edits") or []],
                           kv=[e["kv"] for e in cm.get("applied_edits") or [] if e.get("kv")])
            else:
                row["error"] = json.dumps(payload)[:300] if payload else r.text[:300]
            rows.append(row)
            if think_s and t + 1 < len(requests):
                time.sleep(rng.uniform(0.5, 1.5) * think_s)
    return rows


class VllmDirect:
    """vLLM's own API server on a TCP port, with the arguments agentkv starts it with."""

    def __init__(self, path: str, model: str, window: int, pool: tuple[str, ...] = ()):
        self.path, self.model, self.window, self.pool, self.proc, self.url = path, model, window, pool, None, None

    def __enter__(self) -> "VllmDirect":
        import os

        from agentkv.server.config import ServeConfig
        from agentkv.server.engine.process import engine_args, free_port
        from agentkv.server.engine.supervisor import resolve_model_path

        cfg = ServeConfig(model=self.path, served_model_name=self.model, max_model_len=self.window,
                          engine_args=self.pool)
        argv = engine_args(cfg, resolve_model_path(cfg), "cpu", "unused")
        i = argv.index("--uds")
        port = free_port()
        argv[i:i + 2] = ["--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", **cfg.cpu_env()}
        self.proc, log_path = start_logged([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv],
                                           "agentkv-vllm-", env)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(self.proc, f"{self.url}/health", 900, "vLLM", log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from agentkv.server.engine.process import stop_group

        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace_s=60)


def wide_model(layers: int) -> tuple[str, str]:
    """(path, served name) of a random test model of ``layers`` layers whose positions reach the
    floor arm's window."""
    from agentkv.server.embedded_model import TinyModelSpec, build_model
    from agentkv.server.embedded_model.catalog import models_dir

    name = f"agentkv-tiny-{layers}l-wide"
    return str(build_model(models_dir() / name,
                           TinyModelSpec(layers=layers, max_position_embeddings=FLOOR_WINDOW))), name


def pool_args(pool_tokens: int | None) -> tuple[str, ...]:
    """vLLM's arguments for a KV pool of ``pool_tokens`` tokens (``None``: the engine's own size)."""
    if pool_tokens is None:
        return ()
    return (f"--block-size={POOL_BLOCK}", f"--num-gpu-blocks-override={-(-pool_tokens // POOL_BLOCK)}")


def agentkv_args(arm: str, path: str, model: str, window: int, pool_tokens: int | None = None) -> tuple[str, ...]:
    serve = ("--model", path, "--served-model-name", model,
             "--max-model-len", str(FLOOR_WINDOW if arm == "floor" else window))
    if arm != "floor":          # the floor is what a session costs with room for everything
        serve += tuple(f"--engine-arg={a}" for a in pool_args(pool_tokens))
    serve += SERVE_ARGS.get(arm, ())
    # each arm its own session log: a session's view (what was cleared) must not carry over
    return serve + ("--session-db", str(Path(tempfile.mkdtemp(prefix="agentkv-sessions-")) / "sessions.db"))


# the connector's counters an arm reports (vllm:agentkv_kv_<name>_total): what came back from where
CONNECTOR_COUNTS = ("retained_tokens", "retained_turns", "retain_failed", "reused_tokens", "restores",
                    "restored_blocks", "restore_bytes", "restore_seconds", "spilled_blocks", "dropped_blocks")


def connector_counts(url: str, api_key: str | None) -> dict[str, float]:
    """The KV connector's counters on a running agentkv server (zeros where it runs none)."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                     timeout=60).text
    out = dict.fromkeys(CONNECTOR_COUNTS, 0.0)
    for line in text.splitlines():
        for name in CONNECTOR_COUNTS:
            if line.startswith(f"vllm:agentkv_kv_{name}_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_arm(arm: str, sessions: dict[str, list], path: str, model: str, window: int, copies: int, concurrent: int,
            think_s: float, seed: int, pool_tokens: int | None = None) -> tuple[dict[str, list[dict]], dict]:
    """Each session replayed ``copies`` times on one server of ``arm``, ``concurrent`` at once; and
    what the server's KV connector counted meanwhile (nothing for vLLM reached directly)."""
    ctx = (VllmDirect(path, model, window, pool_args(pool_tokens)) if arm == "vllm"
           else Endpoint(serve_args=agentkv_args(arm, path, model, window, pool_tokens)))
    jobs = [(name, k) for name in sessions for k in range(copies)]
    out: dict[str, list[dict]] = {name: [] for name in sessions}
    counts: dict = {}
    with ctx as ep, ThreadPoolExecutor(concurrent) as pool:
        key = getattr(ep, "api_key", None)
        runs = pool.map(lambda job: replay(ep.url, key, sessions[job[0]], job[1], model,
                                           think_s if concurrent > 1 else 0, seed), jobs)
        for (name, _), rows in zip(jobs, runs):
            out[name].extend(rows)
        if arm != "vllm":
            time.sleep(2)    # vLLM records the engine's counters as it processes outputs
            counts = connector_counts(ep.url, key)
    return out, counts


def latency(lat: list[float]) -> dict:
    """p50 and p99 (nearest rank) of the sorted latencies ``lat``, in seconds."""
    if not lat:
        return {"latency_p50_s": None, "latency_p99_s": None}
    return {"latency_p50_s": round(statistics.median(lat), 3),
            "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)}


def worst_copy(rows: list[dict], floor_rows: list[dict]) -> float | None:
    """The largest ratio of one copy's tokens computed to the same copy's on the floor."""
    ratios = []
    for k in sorted({r["session"] for r in rows}):
        floor = sum(r["computed"] for r in floor_rows if r["session"] == k and r["status"] == 200)
        if floor:
            ratios.append(sum(r["computed"] for r in rows if r["session"] == k) / floor)
    return round(max(ratios), 3) if ratios else None


def summary(rows: list[dict], floor_rows: list[dict] | None) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    computed = sum(r["computed"] for r in ok)
    floor = sum(r["computed"] for r in floor_rows if r["status"] == 200) if floor_rows else None
    lat = sorted(r["latency_s"] for r in ok)
    kv = [k for r in ok for k in r.get("kv") or []]
    return {"turns": len(rows), "answered": len(ok), "failed_from_turn": min((r["turn"] for r in rows
                                                                              if r["status"] != 200), default=None),
            "computed": computed, "floor": floor,
            "ratio": round(computed / floor, 3) if floor and len(ok) == len(rows) else None,
            "worst_copy_ratio": worst_copy(rows, floor_rows) if floor and len(ok) == len(rows) else None,
            "edit_turns": sorted({r["turn"] for r in ok if r.get("edits")}),
            "edits": sum(1 for r in ok if r.get("edits")),      # turns with an edit, over every copy
            "max_prompt": max((r["prompt_tokens"] for r in ok), default=0),
            **latency(lat),
            "kv_reused_tokens": sum(k.get("reused_tokens", 0) for k in kv),
            "kv_edits": len(kv), "kv_edits_reused": sum(1 for k in kv if k.get("reused_tokens")),
            "kv_fallbacks": sorted({k["fallback"] for k in kv if k.get("fallback")})}


def overall(summaries: dict[str, dict], rows: list[dict]) -> dict:
    """One arm over many sessions: turns answered, tokens computed against the floor (sessions
    answered whole), the worst session's ratio, latency over every turn."""
    whole = [s for s in summaries.values() if s["failed_from_turn"] is None]
    rated = [s for s in whole if s["ratio"] is not None]      # ... and a floor to compare with
    computed, floor = sum(s["computed"] for s in rated), sum(s["floor"] for s in rated)
    lat = sorted(r["latency_s"] for r in rows if r["status"] == 200)
    return {"sessions": len(summaries), "sessions_whole": len(whole),
            "turns": sum(s["turns"] for s in summaries.values()),
            "answered": sum(s["answered"] for s in summaries.values()),
            "computed": computed, "floor": floor, "ratio": round(computed / floor, 3) if floor else None,
            "worst_ratio": max((s["worst_copy_ratio"] for s in rated), default=None),
            "edits": sum(s["edits"] for s in summaries.values()),
            "max_prompt": max(s["max_prompt"] for s in summaries.values()),
            **latency(lat),
            "kv_reused_tokens": sum(s["kv_reused_tokens"] for s in summaries.values()),
            "kv_edits": sum(s["kv_edits"] for s in summaries.values()),
            "kv_edits_reused": sum(s["kv_edits_reused"] for s in summaries.values()),
            "kv_fallbacks": sorted({f for s in summaries.values() for f in s["kv_fallbacks"]})}


def plot(result: dict, title: str):
    plt = pyplot()
    names = list(result["sessions"])
    if len(names) > 4:          # many conversations: their ratios, and every turn's latency
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.2))
        arms = [a for a in result["overall"] if a not in ("vllm", "floor")]
        for n, arm in enumerate(arms):
            a1.bar([i + 0.8 * n / len(arms) for i in range(len(names))],
                   [result["sessions"][s]["summary"][arm]["ratio"] or 0 for s in names], width=0.8 / len(arms),
                   label=arm)
        a1.axhline(1.0, color="gray", lw=0.8)
        a1.set_xticks(range(len(names)), [s.removeprefix("trace_") for s in names], rotation=90, fontsize=6)
        a1.set_ylabel("tokens computed / floor")
        a1.legend(fontsize=7)
        for arm in result["overall"]:
            lat = sorted(r["latency_s"] for s in names for r in result["sessions"][s]["rows"][arm]
                         if r["status"] == 200)
            a2.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=f"{arm} (p99 "
                    f"{result['overall'][arm]['latency_p99_s']} s)")
        a2.set_xscale("log")
        a2.set_xlabel("latency of a turn, one output token (s)")
        a2.set_ylabel("fraction of turns answered")
        a2.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        return fig
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for arm, rows in result["sessions"][name]["rows"].items():
            first = [r for r in rows if r["session"] == 0]
            ax.plot([r["turn"] for r in first], [r.get("computed", 0) if r["status"] == 200 else 0 for r in first],
                    marker="o", ms=3, label=f"{arm} ({result['sessions'][name]['summary'][arm]['answered']}/"
                                             f"{result['sessions'][name]['summary'][arm]['turns']} answered)")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("turn")
        ax.set_ylabel("tokens computed (0: failed)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench sessions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", nargs="+", type=Path, default=sorted(DATA.glob("*.json.xz")),
                    help="recorded sessions (default: every one in benchmarks/data/sessions)")
    ap.add_argument("--traces", type=int, default=0, metavar="N",
                    help="replay the first N public Claude Code traces (benchmarks/data/traces) instead")
    ap.add_argument("--trace-words", type=int, default=16,
                    help="--traces: words (about tokens) per 64-token block of a trace (16: a quarter scale)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS),
                    help="shift-no-tier: shift with no host tier for held K/V (--kv-offload-gib 0)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the random test model served (its "
                    "positions reach 262,144 tokens)")
    ap.add_argument("--window", type=int, default=65536, help="context window of the vllm/recompute/shift arms")
    ap.add_argument("--copies", type=int, default=1, help="times each session is replayed (each copy its own "
                    "session, sharing no cache with the others)")
    ap.add_argument("--concurrent", type=int, default=1, help="sessions (and copies) replayed at once")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a session's turns (concurrent)")
    ap.add_argument("--pool-tokens", type=int, default=None,
                    help="KV pool of every arm but the floor, in tokens (vLLM's --num-gpu-blocks-override, blocks "
                         f"of {POOL_BLOCK}); default the engine's own (1 GiB on a CPU: millions of tokens of the "
                         "test model). Make it a few windows to have sessions compete for blocks as on a GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", choices=sorted(PACKAGES), help="record a session instead (see --tree)")
    ap.add_argument("--tree", type=Path, help="--record: the source tree the client works in")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    if args.record:
        from .session_record import record

        if not args.tree or not args.tree.is_dir():
            ap.error("--record needs --tree DIR, a source tree for the client to work in")
        print(f"wrote {record(args.record, args.tree, Path(tempfile.mkdtemp(prefix='agentkv-record-')))}")
        return {}
    if (args.concurrent < 1 or args.copies < 1 or args.traces < 0 or not 1 <= args.trace_words <= 64
            or not 1024 <= args.window <= FLOOR_WINDOW or not 1 <= args.layers <= 32
            or (args.pool_tokens is not None and args.pool_tokens < args.window)):
        ap.error(f"--concurrent and --copies must be >= 1, --traces >= 0, --trace-words 1..64, "
                 f"--window 1024..{FLOOR_WINDOW}, --layers 1..32, --pool-tokens at least --window")
    path, model = wide_model(args.layers)
    if args.traces:
        from .traces import conversation
        from .traces import load as load_traces

        traces = load_traces()
        if args.traces > len(traces):
            ap.error(f"--traces: the fixture holds {len(traces)} traces")
        sessions = {t["id"]: conversation(t, args.trace_words) for t in traces[:args.traces]}
    else:
        sessions = {p.name.removesuffix(".json.xz"): load(p)["requests"] for p in args.sessions}
    arms = [a for a in ARMS if a in args.arms]
    runs = {a: run_arm(a, sessions, path, model, args.window, args.copies, args.concurrent, args.think_s, args.seed,
                       args.pool_tokens) for a in arms}
    rows = {a: r[0] for a, r in runs.items()}
    m = machine()
    result = {"machine": m, "model": model, "window": args.window, "pool_tokens": args.pool_tokens,
              "copies": args.copies,
              "concurrent": args.concurrent, "think_s": args.think_s if args.concurrent > 1 else 0,
              "workload": (f"{len(sessions)} kv-cache-tester traces, {args.trace_words} words per 64-token block"
                           if args.traces else "recorded client sessions"),
              "trace_words": args.trace_words if args.traces else None, "sessions": {}, "overall": {}}
    table = []
    for name in sessions:
        floor_rows = rows["floor"][name] if "floor" in rows else None
        summ = {a: summary(rows[a][name], floor_rows) for a in arms}
        result["sessions"][name] = {"summary": summ, "rows": {a: rows[a][name] for a in arms}}
    for a in arms:
        s = result["overall"][a] = overall({n: v["summary"][a] for n, v in result["sessions"].items()},
                                           [r for n in sessions for r in rows[a][n]])
        table.append([a, f"{s['sessions_whole']}/{s['sessions']}", f"{s['answered']}/{s['turns']}", s["computed"],
                      s["floor"], s["ratio"] or "", s["worst_ratio"] or "", s["edits"], s["max_prompt"],
                      s["latency_p50_s"] or "", s["latency_p99_s"] or "", s["kv_reused_tokens"],
                      ",".join(s["kv_fallbacks"])])
    name = (("sessions-traces" if args.traces else "sessions") + (f"-c{args.copies}" if args.copies > 1 else "")
            + (f"-x{args.concurrent}" if args.concurrent > 1 else "")
            + (f"-pool{args.pool_tokens // 1024}k" if args.pool_tokens else ""))
    what = f"{model}, window {args.window}, {args.copies} cop{'y' if args.copies == 1 else 'ies'} each, " \
           f"{args.concurrent} at once" + (f", KV pool {args.pool_tokens} tokens" if args.pool_tokens else "")
    jpath, ppath = write_results(name, result, plot(result, f"{name}: {what}\n{machine_line(m)}"),
                                 args.out or DEFAULT_OUT)
    print_table(f"{result['workload']} replayed ({what})",
                ["arm", "whole sessions", "turns answered", "computed", "floor", "x floor", "worst session",
                 "edits", "max prompt", "p50 s", "p99 s", "KV reused", "fallbacks"], table, machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


DEFAULT_OUT = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    main()
