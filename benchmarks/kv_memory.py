"""KV cache memory: bytes per token from a model config (GQA, MLA latent caches, sliding-window
layers, fp8 KV) and measured from the running engine's allocation; and, for an agent session,
the KV held at each turn with no management, with clearing, and with summarization.

Usage: ``agentkv bench kv-memory [--quick] [--url URL --api-key KEY]``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .harness import machine, machine_line, print_table, write_results, pyplot

CONFIGS = Path(__file__).resolve().parent / "configs"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
GIB = 2 ** 30


def kv_bytes(config: dict, tokens: int, kv_dtype: str | None = None) -> int:
    """Bytes of KV cache that ``tokens`` tokens of one sequence hold.

    Per layer and token: ``2 * kv_heads * head_dim`` elements (K and V), or for MLA
    ``kv_lora_rank + qk_rope_head_dim`` (one latent vector and the rotary key). A sliding-window
    layer holds at most ``sliding_window`` tokens."""
    width = DTYPE_BYTES[kv_dtype or config.get("dtype") or config.get("torch_dtype") or "bfloat16"]
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_layer = 2 * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    types = config.get("layer_types") or ["full_attention"] * layers
    window = config.get("sliding_window") or tokens
    held = sum(min(tokens, window) if t == "sliding_attention" else tokens for t in types)
    return held * per_layer * width


def known_configs() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}


def config_table(context: int) -> list[dict]:
    rows = []
    for key, cfg in known_configs().items():
        for dtype in (None, "fp8"):
            b = kv_bytes(cfg, context, dtype)
            rows.append({"model": cfg["name"], "kv_dtype": dtype or cfg.get("torch_dtype") or "bfloat16",
                         "context": context, "gib_per_token": b / context / GIB,
                         "kib_per_token": b / context / 1024, "gib_at_context": b / GIB})
    return rows


def measured(http) -> dict:
    """The engine's own numbers from vLLM's ``cache_config_info``: blocks, block size and the bytes
    it allocated for KV, so bytes per token = allocation / (blocks * block_size)."""
    text = http.get("/metrics").text
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    if not m:
        raise RuntimeError("vllm:cache_config_info is missing from /metrics")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    out = {"num_blocks": blocks, "block_size": block_size, "tokens_capacity": blocks * block_size,
           "cache_dtype": labels.get("cache_dtype"), "labels": labels}
    if labels.get("kv_cache_memory_bytes", "None") != "None":
        out["allocated_bytes"] = int(labels["kv_cache_memory_bytes"])
        out["bytes_per_token"] = out["allocated_bytes"] / out["tokens_capacity"]
    return out


def session_turns(http, model: str, window: int, bytes_per_token: float, quick: bool) -> list[dict]:
    """KV held at each turn of the delayed-recall session under three policies (prompt tokens
    the engine holds for the request, times bytes per token)."""
    import uuid

    from .scenario import Scenario

    clear = {"type": "clear_tool_uses", "trigger": window // 2, "keep": 3, "clear_at_least": window // 10}
    policies = {"none": {"edits": []}, "clearing": {"edits": [clear]},
                "summarization": {"edits": [clear, {"type": "compact", "trigger": window * 3 // 4,
                                                    "keep_recent_tokens": window * 3 // 10}]}}
    sc = Scenario.make(0, noise_lines=20 if quick else 90)
    turns = [sc.opening[:2 + 2 * i] + [{"role": "user", "content": "continue"}] for i in range(1, 7)]
    history = sc.opening
    for t in sc.reading_turns[: 2 if quick else 9]:
        history = history + t
        turns.append(history + [{"role": "user", "content": "continue"}])
    rows = []
    llama = known_configs()["llama-3-8b"]
    for name, policy in policies.items():
        sid = f"kvmem-{uuid.uuid4().hex[:10]}"
        for i, msgs in enumerate(turns):
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                "model": model, "messages": msgs, "max_tokens": 1, "context_management": policy})
            r.raise_for_status()
            held = r.json()["usage"]["prompt_tokens"]
            rows.append({"policy": name, "turn": i + 1, "prompt_tokens": held,
                         "gib_served_model": held * bytes_per_token / GIB,
                         "gib_if_llama_3_8b": kv_bytes(llama, held) / GIB})
    return rows


def plot(result: dict):
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    bf16 = [r for r in result["configs"] if r["kv_dtype"] != "fp8"]
    a.barh([r["model"] for r in bf16], [r["kib_per_token"] for r in bf16])
    a.set_xlabel(f"KiB of KV per token at {bf16[0]['context']} tokens (bf16)")
    for policy in dict.fromkeys(r["policy"] for r in result["session"]):
        rs = [r for r in result["session"] if r["policy"] == policy]
        b.plot([r["turn"] for r in rs], [r["gib_if_llama_3_8b"] for r in rs], "o-", label=policy)
    b.set_xlabel("turn")
    b.set_ylabel("KV GiB held (Llama-3-8B shapes)")
    b.legend()
    fig.suptitle(f"KV memory; served {result['model']}: measured "
                 f"{result['measured'].get('bytes_per_token', float('nan')):.0f} B/token\n"
                 f"{machine_line(result['machine'])}", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    from .harness import Endpoint, add_endpoint_args

    ap = argparse.ArgumentParser(prog="agentkv bench kv-memory", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short session (smoke test)")
    ap.add_argument("--context", type=int, default=32768, help="context for the per-token table")
    ap.add_argument("--window", type=int, default=16384, help="simulated window for the session policies")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    with Endpoint(args.url, args.api_key) as ep, ep.http() as http:
        info = ep.model()
        meas = measured(http)
        served = {"measured_bytes_per_token": meas.get("bytes_per_token")}
        root = info.get("root")
        if root and (Path(root) / "config.json").is_file():
            served["formula_bytes_per_token"] = kv_bytes(json.loads((Path(root) / "config.json").read_text()),
                                                         1, None if meas.get("cache_dtype") in (None, "auto")
                                                         else meas["cache_dtype"])
        window = 2048 if args.quick else args.window
        session = session_turns(http, info["id"], window, meas.get("bytes_per_token") or 0.0, args.quick)
    m = machine()
    result = {"machine": m, "model": info["id"], "measured": meas, "served_model": served,
              "configs": config_table(args.context), "session": session}
    name = "kv-memory" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(result), args.out)
    print_table("KV cache per token", ["model", "kv dtype", "KiB/token", "GiB/token", f"GiB @ {args.context}"],
                [[r["model"], r["kv_dtype"], r["kib_per_token"], f"{r['gib_per_token']:.3e}", r["gib_at_context"]]
                 for r in result["configs"]], machine_line(m))
    print(f"served {info['id']}: measured {meas.get('bytes_per_token')} B/token "
          f"({meas['num_blocks']} blocks x {meas['block_size']} tokens); formula "
          f"{served.get('formula_bytes_per_token')} B/token")
    print_table("KV held per turn", ["policy", "turn", "prompt tokens", "GiB (served)", "GiB (Llama-3-8B)"],
                [[r["policy"], r["turn"], r["prompt_tokens"], f"{r['gib_served_model']:.4f}", r["gib_if_llama_3_8b"]]
                 for r in session], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
