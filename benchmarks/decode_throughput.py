"""Decode throughput and TTFT against context size and batch size, on the real engine.

Each request is a /v1/completions call with a token-id prompt of exactly the context size (fresh
random ids, so no prefix-cache hits), streamed, with ``ignore_eos`` so every request decodes
``--tokens`` tokens. Usage: ``agentkv bench decode-throughput [--quick] [--url URL]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from .harness import Endpoint, add_endpoint_args, machine, machine_line, print_table, pyplot, write_results


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], tokens: int) -> dict:
    """One streamed completion: its first and last text chunk's times and its tokens as the engine
    counts them (usage: a chunk may carry more than one token when the reader falls behind)."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    n = 0
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
                n = (chunk.get("usage") or {}).get("completion_tokens") or n
    n = n or len(stamps)
    return {"ttft_s": stamps[0] - t0, "tokens": n, "end": stamps[-1],
            "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else None}


async def measure(url: str, api_key: str | None, model: str, vocab: int, context: int, batch: int,
                  tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, vocab) for _ in range(context)] for _ in range(batch)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=900) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_request(client, model, p, tokens) for p in prompts))
    wall = max(r["end"] for r in res) - t0
    per = [r["decode_tok_s"] for r in res if r["decode_tok_s"]]
    return {"context": context, "batch": batch, "tokens_per_request": tokens,
            "ttft_s_mean": sum(r["ttft_s"] for r in res) / batch,
            "decode_tok_s_per_request": sum(per) / len(per) if per else None,
            "aggregate_tok_s": sum(r["tokens"] for r in res) / wall, "wall_s": wall}


def plot(rows: list[dict], title: str):
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch]
        a.plot([r["context"] for r in rs], [r["aggregate_tok_s"] for r in rs], "o-", label=f"batch {batch}")
        b.plot([r["context"] for r in rs], [r["ttft_s_mean"] for r in rs], "o-", label=f"batch {batch}")
    for ax, label in ((a, "aggregate decode tokens/s"), (b, "mean TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="agentkv bench decode-throughput", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two small contexts, batch 1 and 2 (smoke test)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per request")
    add_endpoint_args(ap)
    args = ap.parse_args(argv)
    contexts, batches, tokens = ([256, 1024], [1, 2], 8) if args.quick else (args.contexts, args.batches, args.tokens)
    from tqdm import tqdm

    with Endpoint(args.url, args.api_key) as ep:
        info = ep.model()
        model = info["id"]
        vocab = 1000  # ids 16..999 exist in any tokenizer and skip the usual special ids
        contexts = [c for c in contexts if c + tokens <= info["max_model_len"]]
        rows = []
        for i, (c, b) in enumerate(tqdm([(c, b) for c in contexts for b in batches], desc="decode throughput")):
            rows.append(asyncio.run(measure(ep.url, ep.api_key, model, vocab, c, b, tokens, seed=i)))
    m = machine()
    result = {"machine": m, "model": model, "rows": rows}
    name = "decode-throughput" + ("-quick" if args.quick else "")
    jpath, ppath = write_results(name, result, plot(rows, f"decode throughput, {model}\n{machine_line(m)}"), args.out)
    print_table(f"decode throughput ({model})", ["context", "batch", "TTFT s", "tok/s per req", "aggregate tok/s"],
                [[r["context"], r["batch"], r["ttft_s_mean"], r["decode_tok_s_per_request"] or "",
                  r["aggregate_tok_s"]] for r in rows], machine_line(m))
    print(f"wrote {jpath} and {ppath}")
    return result


if __name__ == "__main__":
    main()
