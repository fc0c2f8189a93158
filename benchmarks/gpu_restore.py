"""GPU: a paused session's prompt read back from the host tier (retention), against recomputing it.
8k..64k tokens of Llama-3-8B-shaped K/V (32 layers, 8 KV heads, head_dim 128, bf16, 16-token
blocks in vLLM's CUDA layout) are spilled to pinned host memory and read back into other blocks by
the connector's own worker code (``worker.KVMover``: ``spill``, then a load whose source is the
host tier: its blocks staged to the device, ``move_tokens`` at delta 0, layer by layer), timed
(median of 3) and checked bit for bit against what was spilled. The prefill of the same tokens is
``gpu-prefill``'s, read from its results file where it is there.

Needs torch, triton and transformers (no vLLM, no server): on a bare GPU machine, with the shim
``gpu_check``'s docstring describes, ``python -m agentkv.benchmarks.gpu_restore``. ``--quick`` runs
it on this machine's device (the CPU: the host tier is the device's own memory there) at small
sizes and 2 layers: what the test suite runs. Not run on a GPU yet (no GPU lent since it was written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .harness import RESULTS, machine, machine_line, print_table, pyplot, write_results

SIZES = (8192, 16384, 32768, 65536)
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def kv_bytes(tokens: int, layers: int) -> int:
    """K and V of every layer, bf16."""
    return tokens * layers * KV_HEADS * HEAD_DIM * 2 * 2


def _rope():
    from transformers import LlamaConfig

    from agentkv.kernels.rope import RopeParams

    return RopeParams.from_hf_config(LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=KV_HEADS,
                                                 rope_theta=500000.0, max_position_embeddings=131072))


def measure_one(tokens: int, layers: int, device: str, repeats: int = 3) -> dict:
    import torch

    from agentkv.kernels.connector.worker import KVMover, LoadSpec

    nb = tokens // BLOCK
    shape = (2, 2 * nb, BLOCK, KV_HEADS, HEAD_DIM) if device == "cuda" else (2 * nb, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    caches = {f"layer.{i}": torch.randn(shape, dtype=torch.bfloat16, device=device) for i in range(layers)}
    mover = KVMover(_rope(), BLOCK, host_blocks=nb)
    t0 = time.perf_counter()
    mover.register(caches)                              # allocates the host tier (pinned beside a GPU)
    alloc_s = time.perf_counter() - t0
    assert mover.host is not None and not mover.problem, mover.problem or mover.host_lost
    src, dst = list(range(nb)), list(range(nb, 2 * nb))
    t0 = time.perf_counter()
    mover.spill(list(zip(src, range(nb))), nb)          # the held prompt's blocks, to host blocks 0..nb-1
    if device == "cuda":
        torch.cuda.synchronize()
    spill_s = time.perf_counter() - t0
    spec = LoadSpec("restore", dst, [list(range(nb))], [(0, 0, 0, tokens)], [True])
    times = []
    for _ in range(repeats):
        for t in caches.values():                       # the destination blocks hold something else first
            (t[:, nb:] if device == "cuda" else t[nb:]).zero_()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        failed = mover.load([spec])
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert not failed, f"the restore failed on blocks {sorted(failed)[:8]}"
    exact = all(torch.equal(t[:, :nb], t[:, nb:]) if device == "cuda" else torch.equal(t[:nb], t[nb:])
                for t in caches.values())
    restore_s = statistics.median(times)
    size = kv_bytes(tokens, layers)
    return {"tokens": tokens, "layers": layers, "kv_gib": size / 2**30, "restore_ms": restore_s * 1e3,
            "all_ms": [x * 1e3 for x in times], "restore_gb_per_s": size / restore_s / 1e9,
            "spill_ms": spill_s * 1e3, "host_tier_alloc_s": alloc_s, "exact": exact}


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    ax.plot(xs, [r["restore_ms"] for r in rows], "o-", label="read back from the host tier (retention)")
    if any(r.get("prefill_ms") for r in rows):
        pts = [(r["tokens"], r["prefill_ms"]) for r in rows if r.get("prefill_ms")]
        ax.plot(*zip(*pts), "s--", label="prefill, the same tokens (gpu-prefill)")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms",
           title=f"{result['shape']}: read back vs recompute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench gpu-restore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--quick", action="store_true", help="this machine's device, 256 and 1024 tokens, 2 layers")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.quick:
        ap.error("needs a CUDA GPU (--quick runs it small on the CPU)")
    sizes, layers = ([256, 1024], 2) if args.quick else (args.sizes, LAYERS)
    if any(n <= 0 or n % BLOCK for n in sizes):
        ap.error(f"--sizes: positive multiples of {BLOCK}")
    rows = [measure_one(n, layers, device) for n in sizes]
    prefill = RESULTS / "gpu-prefill.json"
    if device == "cuda" and prefill.exists():          # the recompute side, measured on a GPU by gpu-prefill
        by_tokens = {r["tokens"]: r["prefill_s"] for r in json.loads(prefill.read_text())["rows"]}
        for r in rows:
            if r["tokens"] in by_tokens:
                r["prefill_ms"] = by_tokens[r["tokens"]] * 1e3
                r["prefill_over_restore"] = r["prefill_ms"] / r["restore_ms"]
    info = machine()
    name = "gpu-restore" + ("-quick" if args.quick else "")
    result = {"benchmark": name, "machine": info, "device": device,
              "shape": f"Llama-3-8B K/V ({layers} layers, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16, "
                       f"{BLOCK}-token blocks)", "rows": rows}
    write_results(name, result, plot(result), args.out or RESULTS)
    print_table(name, ["tokens", "KV GiB", "read back ms", "GB/s", "exact", "prefill ms", "prefill / read back"],
                [[r["tokens"], round(r["kv_gib"], 3), round(r["restore_ms"], 2), round(r["restore_gb_per_s"], 1),
                  r["exact"], round(r["prefill_ms"]) if r.get("prefill_ms") else "",
                  round(r["prefill_over_restore"], 1) if r.get("prefill_over_restore") else ""] for r in rows],
                machine_line(info))
    return result


if __name__ == "__main__":
    main()
