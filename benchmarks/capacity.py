"""The capacity curve: ``bench sessions`` (real client sessions replayed, copies of each, several at
once) on KV pools of a few windows, per arm: how many tokens each arm computes against the floor,
and its latency, as the pool shrinks against what the sessions hold.

A GPU serving agents runs with a pool of a few windows for many sessions, so their prefix caches are
evicted while their tools run. Each pool size (``--pool-windows``, in windows of ``--window``
tokens) gets a server per arm (``sessions.ARMS``: agentkv with retention, without it, vLLM reached
directly), the floor one server of its own (a window the sessions never fill, an unbounded pool).
Per pool and arm: turns answered, tokens computed and their ratio to the floor (the worst copy's
too), p50/p99 latency of a turn (one output token), and the KV connector's counters: tokens read
back for turns with no edit (``retained``), moved for edits (``reused``), bytes restored from the
host tier, per turn. One JSON, one plot (tokens computed / floor and p99 against pool size, a line
per arm), one table. Every server it starts is stopped on every way out.

``agentkv bench capacity [--pool-windows 2 4 8] [--copies 2] [--concurrent 8]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .harness import RESULTS, machine, machine_line, print_table, pyplot, write_results
from .session_record import DATA, load
from .sessions import FLOOR_WINDOW, overall, run_arm, summary, wide_model

ARMS = ("vllm", "recompute", "shift", "recompute-no-retention", "shift-no-retention")


def per_turn(counts: dict, turns: int) -> dict:
    """The connector's counts of an arm, and per turn answered."""
    if not counts or not turns:
        return {}
    return {**{k: round(v, 4) for k, v in counts.items()},
            "retained_tokens_per_turn": round(counts["retained_tokens"] / turns, 1),
            "restore_mib_per_turn": round(counts["restore_bytes"] / turns / 2**20, 3)}


def curve(sessions: dict[str, list], path: str, model: str, window: int, pools: list[int], arms: list[str],
          copies: int, concurrent: int, think_s: float, seed: int) -> dict:
    """Every arm at every pool size, and the floor once: ``{"floor": ..., "pools": {W: {arm: ...}}}``
    with each arm's overall summary (its ``connector`` counts added) and its rows per session."""
    floor_rows, _ = run_arm("floor", sessions, path, model, window, copies, concurrent, think_s, seed)
    out: dict = {"floor": {"overall": overall({n: summary(floor_rows[n], floor_rows[n]) for n in sessions},
                                              [r for n in sessions for r in floor_rows[n]]),
                           "rows": floor_rows},
                 "pools": {}}
    for w in pools:
        at = out["pools"][str(w)] = {"pool_tokens": w * window, "arms": {}}
        for arm in arms:
            rows, counts = run_arm(arm, sessions, path, model, window, copies, concurrent, think_s, seed, w * window)
            summaries = {n: summary(rows[n], floor_rows[n]) for n in sessions}
            o = overall(summaries, [r for n in sessions for r in rows[n]])
            o["connector"] = per_turn(counts, o["answered"])
            at["arms"][arm] = {"overall": o, "sessions": summaries, "rows": rows}
            print(f"pool {w} windows, {arm}: {o['answered']}/{o['turns']} turns, {o['ratio']}x the floor, "
                  f"p99 {o['latency_p99_s']} s", flush=True)
    return out


COLORS = {"vllm": "tab:gray", "recompute": "tab:blue", "recompute-no-retention": "tab:blue", "shift": "tab:orange",
          "shift-no-retention": "tab:orange"}


def plot(result: dict, title: str):
    plt = pyplot()
    from matplotlib import ticker

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    pools = sorted(int(w) for w in result["pools"])
    arms = list(next(iter(result["pools"].values()))["arms"])
    for arm in arms:
        o = [result["pools"][str(w)]["arms"][arm]["overall"] for w in pools]
        answered = ", ".join(f"{x['answered']}/{x['turns']}" for x in o)
        style = {"color": COLORS.get(arm), "marker": "o", "ls": "--" if arm.endswith("-no-retention") else "-"}
        if any(x["ratio"] is not None for x in o):
            a1.plot(pools, [x["ratio"] for x in o], label=arm, **style)
        a2.plot(pools, [x["latency_p99_s"] for x in o], label=f"{arm} (turns answered {answered})", **style)
    floor = result["floor"]["overall"]
    a1.axhline(1.0, color="gray", lw=0.8, ls="--", label="the floor (1.0)")
    a2.axhline(floor["latency_p99_s"], color="gray", lw=0.8, ls="--", label=f"the floor ({floor['latency_p99_s']} s)")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(pools, [f"{w} windows\n{w * result['window'] // 1024}k tokens" for w in pools], fontsize=7)
        ax.set_xlabel("KV pool")
        ax.legend(fontsize=6.5)
    a1.set_yscale("log")
    a1.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    a1.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x" if v in (2, 3, 5) else ""))
    a1.set_ylabel("tokens computed / the floor's (sessions answered whole)")
    a2.set_ylabel("latency of a turn, p99 (s, one output token)")
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", nargs="+", type=Path, default=sorted(DATA.glob("*.json.xz")),
                    help="recorded sessions (default: every one in benchmarks/data/sessions)")
    ap.add_argument("--pool-windows", nargs="+", type=int, default=[2, 4, 8],
                    help="KV pool sizes, in windows (vLLM's --num-gpu-blocks-override, blocks of 128)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--window", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=1, help="layers of the random test model served")
    ap.add_argument("--copies", type=int, default=2, help="copies of each session (each its own session)")
    ap.add_argument("--concurrent", type=int, default=8, help="sessions replayed at once")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a session's turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=None, help="replay only each session's first N turns")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    if (args.concurrent < 1 or args.copies < 1 or not 1024 <= args.window <= FLOOR_WINDOW
            or not 1 <= args.layers <= 32 or any(w < 1 for w in args.pool_windows)
            or (args.turns is not None and args.turns < 1)):
        ap.error(f"--concurrent, --copies, --pool-windows and --turns must be >= 1, --window 1024..{FLOOR_WINDOW}, "
                 "--layers 1..32")
    path, model = wide_model(args.layers)
    sessions = {p.name.removesuffix(".json.xz"): load(p)["requests"][:args.turns] for p in args.sessions}
    arms = [a for a in ARMS if a in args.arms]
    pools = sorted(set(args.pool_windows))
    data = curve(sessions, path, model, args.window, pools, arms, args.copies, args.concurrent, args.think_s,
                 args.seed)
    m = machine()
    result = {"machine": m, "model": model, "window": args.window, "copies": args.copies,
              "concurrent": args.concurrent, "think_s": args.think_s, "sessions": sorted(sessions),
              "turns_per_session": {n: len(r) for n, r in sessions.items()}, "pool_windows": pools, **data}
    rows = []
    for w in pools:
        for arm, a in result["pools"][str(w)]["arms"].items():
            o, c = a["overall"], a["overall"]["connector"]
            rows.append([w, arm, f"{o['answered']}/{o['turns']}", o["ratio"] or "", o["worst_ratio"] or "",
                         o["latency_p50_s"], o["latency_p99_s"], c.get("retained_tokens_per_turn", ""),
                         c.get("restore_mib_per_turn", ""), o["kv_reused_tokens"], ",".join(o["kv_fallbacks"])])
    f = result["floor"]["overall"]
    rows.append(["-", "floor", f"{f['answered']}/{f['turns']}", 1.0, 1.0, f["latency_p50_s"], f["latency_p99_s"],
                 "", "", "", ""])
    what = (f"{len(sessions)} recorded sessions x {args.copies} copies, {args.concurrent} at once, {model}, "
            f"window {args.window}")
    jpath, ppath = write_results("sessions-capacity", result,
                                 plot(result, f"sessions-capacity: {what}\n{machine_line(m)}"), args.out or RESULTS)
    print_table(f"capacity curve ({what})",
                ["pool (windows)", "arm", "turns answered", "x floor", "worst copy", "p50 s", "p99 s",
                 "read back tokens/turn", "restored MiB/turn", "KV moved (edits)", "fallbacks"], rows,
                machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
