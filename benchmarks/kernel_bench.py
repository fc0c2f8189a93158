"""Eviction kernel throughput: bytes moved, bandwidth and time against retained tokens.

On CPU it times the torch path (the CPU execution path) against the per-token loop; on CUDA it
times the Triton kernel and compares with the device's measured copy bandwidth.
Usage: ``agentkv bench kernel [--quick]`` or ``python -m agentkv.benchmarks.kernel_bench``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agentkv.kernels import PagedKV, RopeParams, Span, build_plan
from agentkv.kernels.evict import apply_plan

from .harness import RESULTS, machine, machine_line, print_table, pyplot, write_results


@dataclass(frozen=True)
class Shape:
    """Default: Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16, llama3 RoPE theta 5e5)."""

    name: str = "llama-3-8b"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    rope_theta: float = 500000.0
    block_size: int = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in GB/s (read + write), from a plain tensor copy."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _time(lambda: b.copy_(a), device, 5) / 1e9


def bench_one(shape: Shape, retained: int, layers: int, backend: str, device: torch.device,
              repeats: int) -> dict:
    """Drop a span of 1/8 of the context, placed before the retained tokens, from ``layers`` layers."""
    dtype = getattr(torch, shape.dtype)
    bs = shape.block_size
    dropped = max(bs, retained // 8)
    src_len = dropped + retained
    n_src, n_dst = -(-src_len // bs), -(-retained // bs)
    caches = [PagedKV.from_flash(torch.randn(2, n_src + n_dst, bs, shape.kv_heads, shape.head_dim,
                                             device=device).to(dtype)) for _ in range(layers)]
    src_bt = torch.arange(n_src, device=device)
    dst_bt = torch.arange(n_src, n_src + n_dst, device=device)
    rope = RopeParams.default(shape.head_dim, shape.rope_theta)
    plan = build_plan(src_len, [Span(0, dropped)], src_bt, dst_bt, bs)
    seconds = _time(lambda: apply_plan(caches, plan, rope, backend=backend), device, repeats)
    row_bytes = shape.kv_heads * shape.head_dim * dtype.itemsize * 2           # K and V of a token
    moved = plan.n_moved * row_bytes * layers * 2                              # read + write
    return {"retained_tokens": retained, "layers": layers, "backend": backend, "seconds": seconds,
            "bytes_moved": moved, "gb_per_s": moved / seconds / 1e9,
            "tokens_per_s": plan.n_moved * layers / seconds}


def run(quick: bool = False, layers: int | None = None, max_loop_tokens: int | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = Shape()
    gpu = device.type == "cuda"
    layers = layers or (shape.layers if gpu else 1)
    sizes = [1024, 4096] if quick else [1024, 4096, 16384, 65536, 131072]
    fast = "triton" if gpu else "torch"
    loop_limit = max_loop_tokens or (1024 if quick else 8192)
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with vLLM
        def tqdm(x, **_):
            return x
    for n in tqdm(sizes, desc="kernel bench"):
        rows.append(bench_one(shape, n, layers, fast, device, 3))
        if n <= loop_limit:
            rows.append(bench_one(shape, n, layers, "loop", device, 1))
    result = {"machine": machine(), "shape": asdict(shape), "device": device.type, "rows": rows}
    if gpu:
        result["device_copy_gb_per_s"] = copy_bandwidth(device)
    speedups = {}
    for r in rows:
        if r["backend"] == "loop":
            f = next(x for x in rows if x["backend"] == fast and x["retained_tokens"] == r["retained_tokens"])
            speedups[r["retained_tokens"]] = r["seconds"] / f["seconds"]
    result["speedup_vs_loop"] = speedups
    return result


def plot(result: dict):
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in sorted({r["backend"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["backend"] == backend]
        ax1.plot([r["retained_tokens"] for r in rs], [r["seconds"] * 1e3 for r in rs], "o-", label=backend)
        ax2.plot([r["retained_tokens"] for r in rs], [r["gb_per_s"] for r in rs], "o-", label=backend)
    if "device_copy_gb_per_s" in result:
        ax2.axhline(result["device_copy_gb_per_s"], ls="--", c="gray", label="device copy")
    for ax, label in ((ax1, "time per call (ms)"), (ax2, "GB/s moved")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("retained tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"evict_spans, {result['shape']['name']} KV, {result['rows'][0]['layers']} layer(s)\n"
                 f"{machine_line(result['machine'])}", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench kernel", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--layers", type=int, help="layers per call (default: 32 on GPU, 1 on CPU)")
    ap.add_argument("--name", default="kernel", help="results file stem (default: kernel)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    result = run(args.quick, args.layers)
    jpath, ppath = write_results(args.name + ("-quick" if args.quick else ""), result, plot(result), args.out)
    rows = [[r["retained_tokens"], r["backend"], r["layers"], r["seconds"] * 1e3, r["gb_per_s"],
             result["speedup_vs_loop"].get(r["retained_tokens"], "") if r["backend"] != "loop" else ""]
            for r in result["rows"]]
    print_table("evict_spans", ["retained", "backend", "layers", "ms", "GB/s", "x vs loop"], rows,
                machine_line(result["machine"]))
    if "device_copy_gb_per_s" in result:
        print(f"device copy bandwidth: {result['device_copy_gb_per_s']:.0f} GB/s")
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
