"""Helpers for the tests that run vLLM in this process with agentkv's connector."""

from __future__ import annotations

import json

STEP_TOKENS = 256


def turn(i: int) -> list[dict]:
    out = "\n".join(f"check {i}.{j}: latency {(i * 31 + j * 7) % 400} ms" for j in range(40))
    return [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": i})}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": out}]


def generate(llm, ids: list[int], params: dict | None, salt: str):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5,
                        extra_args={"kv_transfer_params": {"agentkv": params}} if params else None)
    out = llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, sp, use_tqdm=False)[0]
    return {k: v.logprob for k, v in out.outputs[0].logprobs[0].items()}, out.num_cached_tokens, out.kv_transfer_params
