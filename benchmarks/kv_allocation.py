"""vLLM's own KV allocation for a model, measured: the engine is started in this process (no
server), and the KV cache tensors its worker allocated are read back (their storage bytes, the
number of blocks and the block size), so bytes per token is allocation / (blocks x block size)
as vLLM holds it, not a formula.

Run as ``python -m agentkv.benchmarks.kv_allocation MODEL_DIR`` (prints one JSON line); the
kv-memory benchmark runs it in a subprocess so the engine's memory is returned afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _read(worker) -> dict:
    caches = worker.model_runner.kv_caches
    storages = {}
    for t in caches:   # layers may share one buffer (vLLM's CPU layout): count each storage once
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return {"allocated_bytes": sum(storages.values()), "tensors": len(caches), "buffers": len(storages),
            "tensor_shape": list(caches[0].shape), "dtype": str(caches[0].dtype).removeprefix("torch."),
            "num_blocks": worker.cache_config.num_gpu_blocks, "block_size": worker.cache_config.block_size}


def measure(model: str, max_model_len: int = 2048, kv_cache_gib: int = 1, timeout_s: float = 900) -> dict:
    """Start vLLM on ``model`` in a child process and read its KV allocation."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "agentkv.benchmarks.kv_allocation", model, str(max_model_len)],
                       capture_output=True, text=True, env=env, timeout=timeout_s, cwd="/")
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"measuring vLLM's KV allocation failed ({r.returncode}): {r.stderr[-1500:]}")
    out = json.loads(lines[-1])
    out["tokens_capacity"] = out["num_blocks"] * out["block_size"]
    out["bytes_per_token"] = out["allocated_bytes"] / out["tokens_capacity"]
    return out


def main() -> None:
    import torch
    from vllm import LLM

    llm = LLM(model=sys.argv[1], max_model_len=int(sys.argv[2]), enforce_eager=True,
              dtype="float32" if not torch.cuda.is_available() else "auto")
    print(json.dumps(llm.collective_rpc(_read)[0]), flush=True)


if __name__ == "__main__":
    main()
