"""GPU: the recompute side of clearing. A prefill of a Llama-3-8B-shaped model (random weights:
prefill time does not depend on the values; transformers ``sdpa``, bf16, logits of the last
position only) at 2k..64k tokens, the time the eviction kernel's move of the same tokens' K/V is
set against (``gpu-check``'s bandwidth rows: 32 layers, 8 KV heads, head_dim 128, bf16).

Needs a CUDA GPU, torch and transformers only (no vLLM, no server): on a bare GPU machine, with the
shim ``gpu_check``'s docstring describes, ``python -m agentkv.benchmarks.gpu_prefill``. Median of 3
runs per size (the first run of the first size pays CUDA's warm-up).
"""

from __future__ import annotations

import argparse
import time

from .harness import machine, machine_line, print_table, pyplot, write_results

SIZES = (2048, 8192, 32768, 65536)
LAYERS, KV_HEADS, HEAD_DIM, BYTES = 32, 8, 128, 2


def kv_bytes(tokens: int) -> int:
    """K and V of every layer, bf16."""
    return tokens * LAYERS * KV_HEADS * HEAD_DIM * 2 * BYTES


def measure(sizes=SIZES, repeats: int = 3) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS, num_attention_heads=32,
                      num_key_value_heads=KV_HEADS, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    rows = []
    for n in sizes:
        ids = torch.randint(0, 128000, (1, n), device="cuda")
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = model(input_ids=ids, logits_to_keep=1, use_cache=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            del out
        rows.append({"tokens": n, "prefill_s": sorted(times)[len(times) // 2], "all_s": times,
                     "kv_gib": kv_bytes(n) / 2**30, "move_floor_ms_at_4.3TBps": 2 * kv_bytes(n) / 4.3e12 * 1e3})
        torch.cuda.empty_cache()
    return rows


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["tokens"] for r in result["rows"]]
    ax.plot(xs, [r["prefill_s"] * 1e3 for r in result["rows"]], "o-", label="prefill (recompute)")
    ax.plot(xs, [r["move_floor_ms_at_4.3TBps"] for r in result["rows"]], "s--", label="K/V read+write at 4.3 TB/s")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title="Llama-3-8B shapes: recompute vs move")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench gpu-prefill", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    info = machine()
    result = {"benchmark": "gpu-prefill", "machine": info, "model": "Llama-3-8B shapes, random weights "
              "(transformers LlamaForCausalLM, sdpa, bf16, logits of the last position only)",
              "rows": measure(args.sizes)}
    write_results("gpu-prefill", result, plot(result))
    print_table("gpu-prefill", ["tokens", "prefill s", "KV GiB"],
                [[r["tokens"], r["prefill_s"], r["kv_gib"]] for r in result["rows"]], machine_line(info))
    return result


if __name__ == "__main__":
    main()
