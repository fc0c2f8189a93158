"""Replicas: the load benchmark's agent sessions (``agentkv bench load``) on one replica, then through
the router of ``deploy/router/haproxy.cfg`` to two replicas, and through the same router with
session affinity off (round robin: what a plain load balancer does), each arm in the same run.

Per arm: each session's prefix-cache hit rate after its first turn (the share of its prompt tokens
whose K/V the engine already had), the KV edits the connector reused and those it fell back on
(with ``--kv-reuse shift``, a conversation whose next turn lands on another replica finds no held
blocks there), which replica answered how many requests (the router's own counts), and whether
every session's log is complete. The replicas share one session log (a SQLite file here, or
``--session-db postgresql://...``) and one compaction key.

Two engines share this machine's cores: latencies are reported, but what the arms are compared
on is hit rates and reuse, which do not depend on how busy the machine is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import tempfile
from pathlib import Path

import numpy as np

from . import load
from .harness import RESULTS, Endpoint, machine, machine_line, print_table, pyplot, write_results
from .router import CONFIG, run_router

ARMS = ("one replica", "router, 2 replicas", "round robin, 2 replicas")


def per_replica(arm: dict) -> str:
    """The responses each replica gave through the router (``all``: the arm without one)."""
    return " / ".join(str(v) for _, v in sorted(arm["served_by"].items())) if "served_by" in arm else "all"


def round_robin(config: str) -> str:
    """The router's configuration with session affinity off (the comparison arm)."""
    out = config.replace("    balance hash var(txn.token)\n", "    balance roundrobin\n")
    assert out != config, "the router configuration no longer balances on txn.token"
    return out


def plot(arms: dict, title: str):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(arms)
    for i, name in enumerate(names):
        rates = arms[name]["session_hit_rates"]
        a.scatter([i] * len(rates), rates, s=14, alpha=0.6)
        a.plot([i - 0.2, i + 0.2], [np.mean(rates)] * 2, color="black")
    a.set_xticks(range(len(names)), names, fontsize=8)
    a.set_ylabel("prefix-cache hit rate per session (turns 2..n)")
    a.set_ylim(0, 1.02)
    reused = [arms[n]["kv_reused_tokens"] for n in names]
    fallbacks = [sum(arms[n]["kv_fallbacks"].values()) for n in names]
    x = np.arange(len(names))
    b.bar(x - 0.2, reused, 0.4, label="tokens reused by the KV connector")
    b2 = b.twinx()
    b2.bar(x + 0.2, fallbacks, 0.4, color="tab:red", label="edits recomputed (fallbacks)")
    b.set_xticks(x, names, fontsize=8)
    b.set_ylabel("tokens reused")
    b2.set_ylabel("fallbacks")
    b.legend(loc="upper left", fontsize=7)
    b2.legend(loc="upper right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench replicas", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4 sessions x 4 turns (smoke test)")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent agent sessions per arm")
    ap.add_argument("--turns", type=int, default=8, help="requests per session")
    ap.add_argument("--tool-lines", type=int, default=30, help="lines per tool output")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--kv-reuse", choices=("recompute", "shift"), default="shift",
                    help="KV reuse the sessions ask for after clearing (shift: the replicas run the KV connector)")
    ap.add_argument("--model", help="the replicas' model (default: the embedded SmolLM2)")
    ap.add_argument("--session-db", help="the replicas' shared log (default: one SQLite file for both)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    sessions, turns = (4, 4) if args.quick else (args.sessions, args.turns)
    if sessions < 1 or turns < 2 or sessions * turns > 10_000:
        ap.error("--sessions must be >= 1 and --turns >= 2, with at most 10,000 requests per arm")
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-replicas-"))
    key = work / "compaction.key"
    key.write_text(secrets.token_hex(32))
    db = args.session_db or str(work / "sessions.db")
    # a 2k window: clearing fires within a few turns, as in `bench load`
    serve = ("--max-model-len", "2048", "--session-db", db, "--compaction-key-file", str(key)) + \
        (("--kv-reuse", "shift") if args.kv_reuse == "shift" else ()) + (("--model", args.model) if args.model else ())
    arms: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(Endpoint(serve_args=serve)) for _ in range(2)]
        model = replicas[0].model()["id"]

        def measure(url: str) -> dict:
            return load.measure(url, None, model, sessions, turns, args.tool_lines, args.max_tokens, args.kv_reuse)

        arms[ARMS[0]] = asyncio.run(measure(replicas[0].url))
        for name, config in ((ARMS[1], CONFIG.read_text()), (ARMS[2], round_robin(CONFIG.read_text()))):
            with run_router([r.url for r in replicas], work / name.replace(" ", "-").replace(",", ""),
                            config) as router:
                arms[name] = asyncio.run(measure(router.url))
                arms[name]["served_by"] = router.server_responses()   # the log checks' reads included
    m = machine()
    result = {"machine": m, "model": model, "sessions": sessions, "turns": turns, "kv_reuse": args.kv_reuse,
              "router": "HAProxy with deploy/router/haproxy.cfg", "arms": arms}
    fig = plot(arms, f"replicas: {sessions} sessions x {turns} turns per arm, kv_reuse {args.kv_reuse}, {model}\n"
                     f"{machine_line(m)}")
    name = "replicas" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, fig, args.out)
    print_table(f"replicas ({model}, {sessions} sessions x {turns} turns per arm, kv_reuse {args.kv_reuse})",
                ["arm", "req", "err", "hit mean", "hit min", "edits", "reused", "fallbacks", "per replica", "logs",
                 "p50 s"],
                [[n, a["requests"], a["errors"], a["hit_rate_mean"] or 0.0, a["hit_rate_min"] or 0.0, a["kv_edits"],
                  a["kv_reused_tokens"], sum(a["kv_fallbacks"].values()),
                  per_replica(a),
                  f"{a['logs_complete']}/{sessions}", a["latency_p50_s"] or ""] for n, a in arms.items()],
                machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result
