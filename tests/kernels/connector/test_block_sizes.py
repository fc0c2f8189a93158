"""The connector's geometry in a real vLLM engine, in this process, at each block size vLLM's CPU
backend takes. Its own module: vLLM keeps one KV connector per process for the workers, so an engine
made while another one lives (``test_inprocess``'s) would get that one's worker side (the
geometry check then refuses it: the scheduler's blocks are not the worker's)."""

from __future__ import annotations

import gc

import pytest
import torch

from agentkv.compaction.clearing import clear_tool_uses
from agentkv.compaction.config import ClearToolUses
from agentkv.compaction.prompt import PromptRenderer
from agentkv.kernels.connector.params import prompt_hash, transfer_config
from agentkv.server.embedded_model import TinyModelSpec, build_model

from inprocess_engine import STEP_TOKENS, generate, turn


def clear_once(engine, renderer, session: str, salt: str):
    """One session turn, then a clear with its priming request: (the edit's outcome, its
    logprobs, recompute's logprobs)."""
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    msgs += turn(0) + turn(1) + turn(2)
    first = renderer.render(msgs).token_ids
    generate(engine, first, {"session": session}, salt)
    r = clear_tool_uses(msgs + turn(3), renderer, ClearToolUses(trigger=0, keep=2))
    prime = r.old_ids[:r.edits[0].start] + [t for e in r.edits for t in e.replacement_ids]
    generate(engine, prime, {"session": session, "prime": True}, salt)
    got, _, report = generate(engine, r.new_ids, {"session": session, "held": [len(first), prompt_hash(first)],
                                                   "spans": [[e.start, e.end, len(e.replacement_ids)]
                                                             for e in r.edits]},
                              salt)
    want, _, _ = generate(engine, r.new_ids, None, salt + "-ref")
    return report["agentkv"], got, want


@pytest.mark.parametrize("block_size", [32, 64, 128, 256])
def test_each_block_size_the_cpu_backend_takes_moves_exactly(tmp_path, block_size):
    """vLLM's CPU backend takes block sizes that are multiples of 32 (16 is refused at start-up:
    "No common block size"); at each the connector's geometry check (every layer's KV tensor
    against the scheduler's block size) passes and it moves tokens with recompute's logprobs (1
    layer); a worker verdict it cannot move in turns every edit into a counted ``geometry`` fallback."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_model(tmp_path / "tiny-1l", TinyModelSpec(layers=1))
    engine = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=4096, block_size=block_size,
                 enable_prefix_caching=True, max_num_batched_tokens=STEP_TOKENS,
                 kv_transfer_config=KVTransferConfig(**transfer_config(0.5, 300.0)))
    try:
        connector = engine.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
        assert connector.block_size == block_size and connector.geometry is None, connector.geometry
        outcome, got, want = clear_once(engine, PromptRenderer.from_pretrained(str(model)), "g", f"bs{block_size}")
        assert outcome["fallback"] is None and outcome["reused_tokens"] >= block_size, outcome
        assert max(got, key=got.get) == max(want, key=want.get)
        for tok in set(got) & set(want):
            assert abs(got[tok] - want[tok]) < 2e-3
        # a worker that reported a geometry it cannot move in turns every edit into a counted fallback
        connector.refuse("layer 0: KV tensor blocks hold 64 tokens, the scheduler's 128 (test)")
        outcome, got, want = clear_once(engine, PromptRenderer.from_pretrained(str(model)), "g2", f"bs{block_size}x")
        assert outcome == {"reused_tokens": 0, "fallback": "geometry"}, outcome
        assert max(got, key=got.get) == max(want, key=want.get)
    finally:
        engine.llm_engine.engine_core.shutdown()
        del engine
        gc.collect()
        mp.undo()


def test_geometry_the_worker_cannot_move_in_is_refused():
    """A KV tensor whose blocks are not the scheduler's (vLLM split them into kernel blocks), or
    whose head_dim is not the model's, is never moved in: the worker says why at start-up."""
    from agentkv.kernels import PagedKV, RopeParams
    from agentkv.kernels.connector.worker import KVMover, geometry_problem

    rope = RopeParams.default(32, 10000.0)
    cpu = torch.zeros(8, 2, 64, 64)                      # [blocks, heads, block_size 64, 2 * head_dim 32]
    assert geometry_problem({"l0": PagedKV.from_vllm(cpu)}, 64, rope) is None
    assert "hold 64 tokens, the scheduler's 128" in geometry_problem({"l0": PagedKV.from_vllm(cpu)}, 128, rope)
    assert "head_dim" in geometry_problem({"l0": PagedKV.from_vllm(cpu)}, 64, RopeParams.default(64, 10000.0))
    mixed = {"l0": PagedKV.from_vllm(cpu), "l1": PagedKV.from_vllm(torch.zeros(4, 2, 64, 64))}
    assert "different numbers of blocks" in geometry_problem(mixed, 64, rope)
    mover = KVMover(rope, 128)
    mover.register({"l0": cpu})
    assert mover.problem and not mover.caches
    assert mover.load([]) == set()
