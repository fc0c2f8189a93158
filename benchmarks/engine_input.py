"""Engine input: what a fully prefix-cached agent turn costs by the form its prompt reaches vLLM in.

One agentkv server (the tiny model with a 256k window: no other model here has one) and its own
vLLM engine, reached four ways with the same conversations, A/B interleaved round by round (the
order rotates): through agentkv with token ids (the default ``--engine-input tokens``: the front
renders the prompt and sends vLLM its ids on the chat route), through agentkv with messages (the
request's ``engine_input: "messages"``: vLLM renders them again), vLLM's ``/v1/chat/completions``
directly with the messages (vLLM renders the chat template and tokenizes the whole prompt), and
vLLM's ``/v1/completions`` directly with the same prompt as token ids (vLLM's ``/tokenize`` of the
same messages, not timed: the floor, no chat layer at all).
A tool-heavy conversation is grown to each size, prefilled once per way, then each round adds one
user message; every request asks for one token, so its time is the time to first token.

Per size and way: median time, the paired differences against vLLM with messages (median and the
2.5-97.5 percentiles over rounds), the ratio to it (median of the paired ratios, and its 2.5-97.5
percentiles), vLLM's own render time (vLLM with messages less vLLM with token ids, paired), the
cached tokens vLLM reports, and the CPU time each process
spent per request (agentkv's front, vLLM's API server; the mean over the rounds: the kernel counts
it in 10 ms ticks), which on a shared machine says more than wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from .front import engine_of, processes
from .harness import RESULTS, Endpoint, machine, machine_line, print_table, pyplot, write_results

WAYS = ("agentkv (token ids)", "agentkv (messages)", "vLLM, messages", "vLLM, token ids")
SIZES = (10_000, 50_000, 100_000, 200_000)


def engine_client(pid: int, timeout: float = 1200):
    """An httpx client to the vLLM engine under the agentkv server ``pid`` (its socket and secret)."""
    import httpx

    url, key = engine_of(pid)
    return httpx.Client(transport=httpx.HTTPTransport(uds=url.removeprefix("unix:")), base_url="http://engine",
                        headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def conversation(tokens_of, size: int) -> list[dict]:
    """A tool-heavy agent conversation of at least ``size`` prompt tokens."""
    messages = [{"role": "system", "content": "You are an agent. Inspect the fleet and report."},
                {"role": "user", "content": "Find the slow services."}]
    i = 0
    while tokens_of(messages) < size:
        step = max(1, (size - tokens_of(messages)) // 3000)   # few /tokenize calls on the way up
        for _ in range(step):
            lines = "\n".join(f"service {i} check {j}: ok latency {j * 3} ms region eu-west-{j % 3}" for j in range(60))
            messages += [{"role": "assistant", "content": f"Running diag {i}."}, {"role": "user", "content": lines}]
            i += 1
    return messages


def cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:   # a process that went away counts nothing more
            pass
    return total


def measure(endpoint: Endpoint, sizes: list[int], rounds: int) -> list[dict]:
    pid = endpoint.proc.pid
    roles = processes(pid)
    model = endpoint.model()["id"]
    out = []
    with endpoint.http(timeout=1200) as front, engine_client(pid) as engine:
        def tokens_of(messages: list[dict]) -> list[int]:
            r = engine.post("/tokenize", json={"model": model, "messages": messages, "add_generation_prompt": True})
            r.raise_for_status()
            return r.json()["tokens"]

        for size in sizes:
            base = conversation(lambda m: len(tokens_of(m)), size)
            sid = f"engine-input-{size}-{time.time_ns()}"

            def request(way: str, messages: list[dict], sid: str = sid) -> tuple:
                """(client, path, body, headers) of one way; the token ids are made here, not timed."""
                client, path, body, headers = {
                    WAYS[0]: (front, "/v1/chat/completions", {"messages": messages}, {"X-Session-Id": sid + "-t"}),
                    WAYS[1]: (front, "/v1/chat/completions", {"messages": messages, "engine_input": "messages"},
                              {"X-Session-Id": sid + "-m"}),
                    WAYS[2]: (engine, "/v1/chat/completions", {"messages": messages}, {}),
                }.get(way) or (engine, "/v1/completions", {"prompt": tokens_of(messages)}, {})
                return client, path, {"model": model, "max_tokens": 1, **body}, headers

            def send(req: tuple) -> tuple[float, dict]:
                client, path, body, headers = req
                t0 = time.perf_counter()
                r = client.post(path, json=body, headers=headers)
                elapsed = time.perf_counter() - t0
                r.raise_for_status()
                return elapsed, r.json()["usage"]

            warm = {way: send(request(way, base))[0] for way in WAYS}   # prefills (agentkv's salt is its own)
            rows = {way: {"s": [], "cached": [], "front_cpu_s": [], "api_cpu_s": []} for way in WAYS}
            messages = list(base)
            for r in range(rounds):
                messages = messages + [{"role": "user", "content": f"Question {r}: which service is slowest?"}]
                for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
                    req = request(way, messages)
                    c0 = (cpu_s(roles["front"]), cpu_s(roles["vllm api server"]))
                    elapsed, usage = send(req)
                    c1 = (cpu_s(roles["front"]), cpu_s(roles["vllm api server"]))
                    rows[way]["s"].append(elapsed)
                    rows[way]["cached"].append((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                    rows[way]["front_cpu_s"].append(c1[0] - c0[0])
                    rows[way]["api_cpu_s"].append(c1[1] - c0[1])
                    rows[way]["prompt_tokens"] = usage["prompt_tokens"]
                messages = messages + [{"role": "assistant", "content": f"Service {r} is slow."}]
            ref = np.array(rows[WAYS[2]]["s"])
            render = (ref - np.array(rows[WAYS[3]]["s"])) * 1e3   # vLLM's render + tokenize, paired
            for way in WAYS:
                s = np.array(rows[way]["s"])
                diff, ratio = (s - ref) * 1e3, s / ref
                out.append({"tokens": rows[way]["prompt_tokens"], "size": size, "way": way, "rounds": rounds,
                            "warm_s": warm[way], "median_ms": 1e3 * statistics.median(s),
                            "all_ms": [round(1e3 * x, 3) for x in s],
                            "vs_vllm_messages_median_ms": float(np.median(diff)),
                            "vs_vllm_messages_p2_5_ms": float(np.percentile(diff, 2.5)),
                            "vs_vllm_messages_p97_5_ms": float(np.percentile(diff, 97.5)),
                            "ratio_to_vllm_messages": float(np.median(ratio)),
                            "ratio_p2_5": float(np.percentile(ratio, 2.5)),
                            "ratio_p97_5": float(np.percentile(ratio, 97.5)),
                            "vllm_render_ms": float(np.median(render)),
                            "faster_than_vllm_messages_by_render": bool(np.median(diff) <= -np.median(render)),
                            "cached_tokens": rows[way]["cached"],
                            # CPU time counts in 10 ms ticks: the mean over the rounds, not the median
                            "front_cpu_ms": 1e3 * statistics.fmean(rows[way]["front_cpu_s"]),
                            "vllm_api_server_cpu_ms": 1e3 * statistics.fmean(rows[way]["api_cpu_s"])})
        counts = engine_input_counts(front.get("/metrics").text)
    return out, counts


def engine_input_counts(metrics: str) -> dict[str, float]:
    """The front's chat requests to the engine by path (``tokens``, ``messages:<why>``)."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("agentkv_engine_input_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            path, why = labels["input"].strip('"'), labels["reason"].strip('"')
            out[path + (f":{why}" if why else "")] = float(line.split()[-1])
    return out


def plot(rows: list[dict], title: str):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for way in WAYS:
        mine = [r for r in rows if r["way"] == way]
        a.plot([r["tokens"] for r in mine], [r["median_ms"] for r in mine], marker="o", label=way)
        b.plot([r["tokens"] for r in mine], [r["vllm_api_server_cpu_ms"] + r["front_cpu_ms"] for r in mine],
               marker="o", label=way)
    a.set_xlabel("prompt tokens (all but the new message prefix-cached)")
    a.set_ylabel("time to first token, median (ms)")
    b.set_xlabel("prompt tokens")
    b.set_ylabel("CPU per request: front + vLLM API server (ms)")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench engine-input", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2k and 4k tokens, 3 rounds (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="conversation sizes (prompt tokens)")
    ap.add_argument("--rounds", type=int, default=9, help="new user messages per size (each sent all four ways)")
    ap.add_argument("--out", default=RESULTS, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    sizes, rounds = ([2000, 4000], 3) if args.quick else (args.sizes, args.rounds)
    if rounds < 1 or any(s < 100 or s > 250_000 for s in sizes):
        ap.error("--rounds must be >= 1 and every size 100..250000 tokens")
    from agentkv.server.embedded_model import TinyModelSpec, build_model
    from agentkv.server.embedded_model.catalog import models_dir

    wide = build_model(models_dir() / "agentkv-tiny-wide",
                       TinyModelSpec(max_position_embeddings=262144, eos_weight=3.5))
    # no default context policy: every way must send the engine the same prompt
    serve = ("--model", str(wide), "--served-model-name", "agentkv-tiny-wide", "--max-model-len", "230000",
             "--no-context-management")
    with Endpoint(serve_args=serve) as ep:
        rows, counts = measure(ep, sorted(sizes), rounds)
    m = machine()
    result = {"machine": m, "model": "agentkv-tiny-wide", "rounds": rounds, "rows": rows,
              "engine_input_requests": counts}
    fig = plot(rows, f"engine input: a prefix-cached agent turn, {rounds} rounds A/B, agentkv-tiny-wide\n"
                     f"{machine_line(m)}")
    jpath, ppath = write_results("engine-input" + ("-quick" if args.quick else ""), result, fig, args.out)
    print_table(f"engine input (agentkv-tiny-wide, {rounds} rounds per size, interleaved)",
                ["tokens", "way", "TTFT median ms", "vs vLLM messages ms (median, 95%)", "ratio (95%)",
                 "vLLM render ms", "front CPU ms", "vLLM API server CPU ms"],
                [[r["tokens"], r["way"], r["median_ms"],
                  f"{r['vs_vllm_messages_median_ms']:+.1f} "
                  f"({r['vs_vllm_messages_p2_5_ms']:+.1f}..{r['vs_vllm_messages_p97_5_ms']:+.1f})",
                  f"{r['ratio_to_vllm_messages']:.2f} ({r['ratio_p2_5']:.2f}..{r['ratio_p97_5']:.2f})",
                  r["vllm_render_ms"], r["front_cpu_ms"], r["vllm_api_server_cpu_ms"]] for r in rows],
                machine_line(m))
    for r in rows:
        if r["way"] == WAYS[0]:
            ahead = ("ahead by at least the render" if r["faster_than_vllm_messages_by_render"]
                     else "not ahead by the whole render")
            print(f"{r['tokens']} tokens: agentkv with token ids {r['vs_vllm_messages_median_ms']:+.0f} ms "
                  f"against vLLM with messages, whose render took {r['vllm_render_ms']:.0f} ms: {ahead}")
    print(f"wrote {jpath} and {ppath}")
    return result
