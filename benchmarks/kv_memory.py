"""KV cache memory: bytes per token from a model config (GQA, MLA latent caches, sliding-window
layers, fp8 KV), and for the served model measured from vLLM's own allocation (the KV tensors its
worker allocated, read back; `kv_allocation.py`) next to the formula; and, for an agent session,
the KV held at each turn with no management, with clearing, and with clearing + summarization
(a series whose edit never fired is marked so).

Usage: ``agentkv bench kv-memory [--quick] [--url URL --api-key KEY]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .harness import machine, machine_line, print_table, pyplot, write_results

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
    for cfg in known_configs().values():
        for dtype in (None, "fp8"):
            b = kv_bytes(cfg, context, dtype)
            rows.append({"model": cfg["name"], "kv_dtype": dtype or cfg.get("torch_dtype") or "bfloat16",
                         "context": context, "gib_per_token": b / context / GIB,
                         "kib_per_token": b / context / 1024, "gib_at_context": b / GIB})
    return rows


def session_turns(http, model: str, window: int, bytes_per_token: float, quick: bool) -> list[dict]:
    """KV held at each turn of the delayed-recall session under three policies (prompt tokens
    the engine holds for the request, times bytes per token)."""
    import uuid

    from .scenario import Scenario

    clear = {"type": "clear_tool_uses", "trigger": window // 2, "keep": 3, "clear_at_least": window // 10}
    policies = {"none": {"edits": []}, "clearing": {"edits": [clear]},
                "summarization": {"edits": [clear, {"type": "compact", "trigger": window * 3 // 4,
                                                    "keep_recent_tokens": window * 3 // 10}]}}
    sc = Scenario.make(0, log_lines=10 if quick else 45)
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
            body = r.json()
            held = body["usage"]["prompt_tokens"]
            rows.append({"policy": name, "turn": i + 1, "prompt_tokens": held,
                         "edits_fired": [e["type"] for e in body["context_management"]["applied_edits"]],
                         "gib_served_model": held * bytes_per_token / GIB,
                         "gib_if_llama_3_8b": kv_bytes(llama, held) / GIB})
    return rows


def series_label(rows: list[dict], policy: str) -> str:
    """The policy's name, marked when the edit it is about never fired in the session."""
    fired = {t for r in rows if r["policy"] == policy for t in r["edits_fired"]}
    if policy == "clearing" and not any("clear_tool_uses" in t for t in fired):
        return "clearing (never fired)"
    if policy == "summarization" and not any("compact" in t for t in fired):
        return "summarization (never fired)"
    return policy


def plot(result: dict):
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    bf16 = [r for r in result["configs"] if r["kv_dtype"] != "fp8"]
    a.barh([r["model"] for r in bf16], [r["kib_per_token"] for r in bf16])
    a.set_xlabel(f"KiB of KV per token at {bf16[0]['context']} tokens (bf16)")
    for policy in dict.fromkeys(r["policy"] for r in result["session"]):
        rs = [r for r in result["session"] if r["policy"] == policy]
        b.plot([r["turn"] for r in rs], [r["gib_if_llama_3_8b"] for r in rs], "o-",
               label=series_label(result["session"], policy))
    b.set_xlabel("turn")
    b.set_ylabel("KV GiB held (Llama-3-8B shapes)")
    b.legend()
    fig.suptitle(f"KV memory; served {result['model']}: {result['measured']['bytes_per_token']:.0f} B/token "
                 f"measured from vLLM's allocation, {result['served_model']['formula_bytes_per_token']} by the "
                 f"formula; session window {result['window']}\n"
                 f"{machine_line(result['machine'])}", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    from .harness import Endpoint, add_endpoint_args

    ap = argparse.ArgumentParser(prog="agentkv bench kv-memory", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short session (smoke test)")
    ap.add_argument("--context", type=int, default=32768, help="context for the per-token table")
    ap.add_argument("--window", type=int, help="window the session policies' triggers are fractions of "
                                                   "(default: the served model's)")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    from .kv_allocation import measure

    with Endpoint(args.url, args.api_key) as ep, ep.http() as http:
        info = ep.model()
        root = info.get("root")
        if not (root and (Path(root) / "config.json").is_file()):
            raise SystemExit(f"kv-memory: the served model's folder ({root}) is not on this machine; "
                             "its allocation can only be measured where it is")
        config = json.loads((Path(root) / "config.json").read_text())
        window = 2048 if args.quick else args.window or info["max_model_len"]
        meas = measure(root)
        served = {"measured_bytes_per_token": meas["bytes_per_token"],
                  "formula_bytes_per_token": kv_bytes(config, 1, meas["dtype"])}
        session = session_turns(http, info["id"], window, meas["bytes_per_token"], args.quick)
    m = machine()
    result = {"machine": m, "model": info["id"], "window": window, "measured": meas, "served_model": served,
              "configs": config_table(args.context), "session": session}
    name = "kv-memory" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(result), args.out)
    print_table("KV cache per token", ["model", "kv dtype", "KiB/token", "GiB/token", f"GiB @ {args.context}"],
                [[r["model"], r["kv_dtype"], r["kib_per_token"], f"{r['gib_per_token']:.3e}", r["gib_at_context"]]
                 for r in result["configs"]], machine_line(m))
    print(f"served {info['id']}: {meas['bytes_per_token']:.1f} B/token measured from vLLM's allocation "
          f"({meas['allocated_bytes']} bytes in {meas['buffers']} buffer(s) for {meas['num_blocks']} blocks x "
          f"{meas['block_size']} tokens, {meas['dtype']}); formula {served['formula_bytes_per_token']} B/token")
    print_table(f"KV held per turn (window {window})",
                ["policy", "turn", "prompt tokens", "edits fired", "GiB (served)", "GiB (Llama-3-8B)"],
                [[series_label(session, r["policy"]), r["turn"], r["prompt_tokens"], ",".join(r["edits_fired"]) or "-",
                  f"{r['gib_served_model']:.4f}", r["gib_if_llama_3_8b"]] for r in session], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
