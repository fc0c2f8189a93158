"""GPU readiness of the eviction kernel, in one command that needs only torch and triton.

Correctness: the Triton kernel against the torch path and the per-token loop (whose complex-number
rotation shares no code with either) on whole caches, at Llama-3-8B's KV shape and odd ones (head_dim
96 with partial rotary, GPT-J pairs, blocks of 1 and 128, different source and destination block
sizes, in-place compaction, ``move_tokens`` with a delta per token). Bandwidth: ``apply_plan`` over
32 layers at 16k..128k retained tokens against a torch device-to-device copy of the same bytes; the
goal on a GPU is the kernel at >= 70% of the copy.

Nothing on its path imports vLLM, transformers or the server. On a bare CUDA machine, from the repo:
``mkdir -p /tmp/agentkv-shim/agentkv && ln -sfn "$PWD/kernels" "$PWD/benchmarks" /tmp/agentkv-shim/agentkv/
&& PYTHONPATH=/tmp/agentkv-shim python3 -m agentkv.benchmarks.gpu_check``; where agentkv is
installed, ``agentkv bench gpu-check``. Without CUDA only ``--quick`` runs: the kernel runs in
Triton's interpreter, and the bandwidth rows time the torch path (the CPU path), not the kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():   # Triton runs on CPU only interpreted; chosen before triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agentkv.kernels import PagedKV, RopeParams, Span, build_plan, evict_spans, move_tokens  # noqa: E402
from agentkv.kernels.evict import apply_plan  # noqa: E402

from .harness import RESULTS, machine, machine_line, print_table, pyplot, write_results  # noqa: E402

# (atol, rtol): every backend computes in float32 (the loop in float64) and rounds once to the dtype.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}
GOAL = 0.70            # kernel bandwidth / copy bandwidth, on a GPU


@dataclass(frozen=True)
class Case:
    """One correctness check. ``dst``: "same" (other blocks of the source cache), "in_place" (the
    source's own blocks, staged), "other" (a second cache, ``dst_layers``), "move_tokens"."""

    name: str
    heads: int
    head_dim: int
    rotary_dim: int
    is_neox: bool
    dtype: str
    src_block: int
    dst_block: int
    dst: str = "same"
    layers: int = 2


LLAMA = dict(heads=8, head_dim=128, rotary_dim=128, is_neox=True, dtype="bfloat16")
CASES = [
    Case("llama-3-8b", **LLAMA, src_block=16, dst_block=16),
    Case("llama-3-8b in place", **LLAMA, src_block=16, dst_block=16, dst="in_place"),
    Case("head_dim 96, rot 48", 8, 96, 48, True, "bfloat16", 16, 16),
    Case("gpt-j, head_dim 256, rot 64", 16, 256, 64, False, "float16", 16, 16),
    Case("block 1", **LLAMA, src_block=1, dst_block=1),
    Case("block 128", **LLAMA, src_block=128, dst_block=128),
    Case("16 -> 128, other cache", **LLAMA, src_block=16, dst_block=128, dst="other"),
    Case("128 -> 1, other cache, gpt-j rot 64", 8, 128, 64, False, "bfloat16", 128, 1, dst="other"),
    Case("move_tokens, gpt-j rot 48", 8, 96, 48, False, "float32", 16, 32, dst="move_tokens"),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()                                       # warm-up (and Triton's compile)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw(blocks: int, block: int, case: Case, device) -> torch.Tensor:
    """A layer's whole buffer in vLLM's CUDA layout ``[2, blocks, block, heads, head_dim]``."""
    return torch.randn(2, blocks, block, case.heads, case.head_dim, device=device).to(getattr(torch, case.dtype))


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> int:
    """Slots (block, offset) of a ``[2, blocks, block, heads, head_dim]`` buffer whose K or V changed."""
    return int((before != after).any(dim=0).flatten(2).any(dim=-1).sum())


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> tuple[float, float]:
    """Max |got - want| and the share of the tolerance used, max |got - want| / (atol + rtol |want|):
    at most 1 is ``torch.allclose``."""
    atol, rtol = TOLERANCE[dtype]
    err = used = 0.0
    for g, w in zip(got, want):
        diff = (g.double() - w.double()).abs()
        err = max(err, float(diff.max()))
        used = max(used, float((diff / (atol + rtol * w.double().abs())).max()))
    return err, used


def check_case(case: Case, tokens: int, device: torch.device) -> dict:
    """Run the case with every backend on identical inputs; compare whole buffers (every layer, the
    source and the destination cache), and count the destination slots the kernel wrote."""
    torch.manual_seed(zlib.crc32(case.name.encode()))
    dtype = getattr(torch, case.dtype)
    rope = RopeParams.default(case.head_dim, 500000.0, case.rotary_dim, case.is_neox)
    n_src = -(-tokens // case.src_block)
    spans = [Span(tokens // 40, tokens // 4, 3), Span(tokens // 2, tokens // 2 + tokens // 64 + 1)]
    dst_len = tokens + sum(s.delta for s in spans)
    n_dst = -(-(tokens if case.dst == "move_tokens" else dst_len) // case.dst_block)
    two_caches = case.dst in ("other", "move_tokens")
    src0 = [_raw(n_src + (0 if two_caches else n_dst) + 1, case.src_block, case, device) for _ in range(case.layers)]
    dst0 = [_raw(n_dst + 2, case.dst_block, case, device) for _ in range(case.layers)] if two_caches else src0
    src_bt = torch.randperm(src0[0].shape[1], device=device)[:n_src]
    if case.dst == "in_place":
        dst_bt = src_bt[:n_dst]
    elif two_caches:
        dst_bt = torch.randperm(n_dst + 2, device=device)[:n_dst]
    else:
        used = set(src_bt.tolist())
        dst_bt = torch.tensor([b for b in range(src0[0].shape[1]) if b not in used][:n_dst], device=device)
    n_rep = sum(s.replacement for s in spans)
    rep = [PagedKV.from_rows(torch.randn(n_rep, case.heads, case.head_dim, device=device).to(dtype),
                             torch.randn(n_rep, case.heads, case.head_dim, device=device).to(dtype))
           for _ in range(case.layers)]
    # move_tokens: scattered slots, one delta per token (as the connector calls it)
    src_slots = torch.randperm(n_src * case.src_block, device=device)[:tokens // 2]
    dst_slots = torch.randperm(n_dst * case.dst_block, device=device)[:tokens // 2]
    deltas = torch.randint(-100000, 100000, (tokens // 2,))

    outputs, written = {}, 0
    for backend in ("triton", "torch", "loop"):
        src = [r.clone() for r in src0]
        dst = [r.clone() for r in dst0] if two_caches else src
        if case.dst == "move_tokens":
            for s, d in zip(src, dst):
                move_tokens(PagedKV.from_flash(s), PagedKV.from_flash(d), src_slots, dst_slots, deltas, rope, backend)
            expected_writes = dst_slots.numel()
        else:
            plan = evict_spans([PagedKV.from_flash(r) for r in src], src_bt, tokens, spans, dst_bt, rope,
                               replacement=rep, dst_layers=[PagedKV.from_flash(r) for r in dst] if two_caches else None,
                               backend=backend)
            expected_writes = plan.n_moved + plan.replacement_slots.numel()
        _sync(device)
        outputs[backend] = src + (dst if two_caches else [])
        if backend == "triton":
            written = sum(_changed_slots(b, a) for b, a in zip(dst0, dst))
    err_torch, used_torch = _compare(outputs["triton"], outputs["torch"], dtype)
    err_loop, used_loop = _compare(outputs["triton"], outputs["loop"], dtype)
    atol, rtol = TOLERANCE[dtype]
    return {**asdict(case), "tokens": tokens, "kv_heads": case.heads, "atol": atol, "rtol": rtol,
            "max_abs_err_vs_torch": err_torch, "max_abs_err_vs_loop": err_loop,
            "tolerance_used": max(used_torch, used_loop),
            "slots_written": written, "slots_expected": expected_writes * case.layers,
            "passed": max(used_torch, used_loop) <= 1.0 and written == expected_writes * case.layers}


def bandwidth_row(tokens: int, layers: int, backend: str, device: torch.device, repeats: int) -> dict:
    """Llama-3-8B KV (8 heads, head_dim 128, bf16, block 16): drop the first 1/8 of the context and move
    ``tokens`` retained tokens to other blocks in every layer; and copy the same bytes with torch."""
    bs, heads, head_dim = 16, 8, 128
    dropped = tokens // 8
    n_src, n_dst = (dropped + tokens) // bs, tokens // bs
    raws = [torch.empty(2, n_src + n_dst, bs, heads, head_dim, dtype=torch.bfloat16, device=device).normal_()
            for _ in range(layers)]
    caches = [PagedKV.from_flash(r) for r in raws]
    plan = build_plan(dropped + tokens, [Span(0, dropped)], torch.arange(n_src, device=device),
                      torch.arange(n_src, n_src + n_dst, device=device), bs)
    rope = RopeParams.default(head_dim, 500000.0)
    kernel_s = _median_seconds(lambda: apply_plan(caches, plan, rope, backend=backend), device, repeats)
    first = dropped // bs                       # the moved tokens are whole blocks first..n_src-1

    def copy() -> None:
        for r in raws:
            r[:, n_src:].copy_(r[:, first:n_src])

    copy_s = _median_seconds(copy, device, repeats)
    nbytes = plan.n_moved * heads * head_dim * 2 * 2 * layers * 2      # K and V, bf16, read + write
    raws.clear()    # the closures above hold the lists: emptied, the tensors are freed
    caches.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kernel_gbs, copy_gbs = nbytes / kernel_s / 1e9, nbytes / copy_s / 1e9
    return {"tokens": tokens, "layers": layers, "kernel_backend": backend, "bytes": nbytes,
            "kernel_ms": kernel_s * 1e3, "copy_ms": copy_s * 1e3, "kernel_gb_per_s": kernel_gbs,
            "copy_gb_per_s": copy_gbs, "ratio": kernel_gbs / copy_gbs}


def run(quick: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    if not gpu and not quick:
        raise ValueError("gpu-check needs a CUDA device; without one only --quick runs (Triton interpreted)")
    case_tokens = 64 if quick else 4096
    cases = [Case(**(asdict(c) | {"heads": min(c.heads, 2), "layers": 1})) if quick else c for c in CASES]
    correctness = [check_case(c, case_tokens, device) for c in cases]
    sizes, layers = ([1024, 4096], 2) if quick else ([16384, 32768, 65536, 131072], 32)
    backend = "triton" if gpu else "torch"
    bandwidth = [bandwidth_row(n, layers, backend, device, 3 if quick else 10) for n in sizes]
    if gpu:
        goal = {"target_ratio": GOAL, "met": all(r["ratio"] >= GOAL for r in bandwidth)}
    else:
        goal = {"target_ratio": GOAL, "met": None,
                "note": "no CUDA device: the Triton kernel ran only in the interpreter (correctness); "
                        "bandwidth rows time the torch path against a torch copy, the goal does not apply"}
    return {"machine": machine(), "device": device.type, "quick": quick,
            "triton_interpreted": os.environ.get("TRITON_INTERPRET") == "1",
            "correctness": correctness, "bandwidth": bandwidth, "goal": goal,
            "passed": all(r["passed"] for r in correctness)}


def plot(result: dict):
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["correctness"]
    ax1.barh(range(len(rows)), [max(r["tolerance_used"], 1e-4) for r in rows],
             color=["tab:green" if r["passed"] else "tab:red" for r in rows])
    ax1.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
    ax1.axvline(1.0, ls="--", c="gray")
    ax1.set_xscale("log")
    ax1.set_xlabel("max |triton - reference| / (atol + rtol |reference|)   (pass: <= 1)")
    ax1.set_title("correctness (whole buffers)", fontsize=9)
    bw = result["bandwidth"]
    xs = [r["tokens"] for r in bw]
    ax2.plot(xs, [r["kernel_gb_per_s"] for r in bw], "o-", label=f"kernel ({bw[0]['kernel_backend']})")
    ax2.plot(xs, [r["copy_gb_per_s"] for r in bw], "s--", label="torch copy, same bytes")
    if result["goal"]["met"] is not None:
        ax2.plot(xs, [GOAL * r["copy_gb_per_s"] for r in bw], ":", c="gray", label=f"goal: {GOAL:.0%} of copy")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("retained tokens")
    ax2.set_ylabel("GB/s (read + write)")
    ax2.set_title(f"bandwidth, {bw[0]['layers']} layers, Llama-3-8B KV", fontsize=9)
    ax2.legend()
    fig.suptitle(f"agentkv gpu-check ({'quick' if result['quick'] else 'full'})\n"
                 f"{machine_line(result['machine'])}", fontsize=9, y=1.02)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes; runs on CPU with Triton interpreted")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = ap.parse_args(argv)
    result = run(args.quick)
    name = "gpu_check" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(result), args.out)
    caption = machine_line(result["machine"])
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    tokens = result["correctness"][0]["tokens"]
    print_table(f"gpu-check: Triton vs torch path and loop, whole buffers, {tokens} tokens",
                ["case", "dtype", "blocks", "err torch", "err loop", "atol/rtol", "tol used", "slots", "pass"],
                [[r["name"], short[r["dtype"]], f"{r['src_block']}->{r['dst_block']}", r["max_abs_err_vs_torch"],
                  r["max_abs_err_vs_loop"], f"{r['atol']:g}/{r['rtol']:g}", r["tolerance_used"],
                  f"{r['slots_written']}/{r['slots_expected']}", "yes" if r["passed"] else "NO"]
                 for r in result["correctness"]], caption)
    print_table(f"gpu-check: bandwidth, {result['bandwidth'][0]['kernel_backend']} vs torch copy",
                ["tokens", "layers", "GB", "kernel ms", "GB/s", "copy ms", "GB/s", "ratio"],
                [[r["tokens"], r["layers"], r["bytes"] / 1e9, r["kernel_ms"], r["kernel_gb_per_s"], r["copy_ms"],
                  r["copy_gb_per_s"], r["ratio"]] for r in result["bandwidth"]], caption)
    goal = result["goal"]
    print(goal["note"] if goal["met"] is None else
          f"goal kernel >= {GOAL:.0%} of copy bandwidth: {'met' if goal['met'] else 'NOT met'}")
    print(f"correctness: {'all passed' if result['passed'] else 'FAILED'}; wrote {jpath} and {ppath}")
    if not result["passed"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
