"""evict_spans / move_tokens: every backend (Triton interpreted on CPU, torch, per-token loop) against
an oracle that shares no code with them (tests/kernel_reference.py), comparing whole caches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPTJConfig, PhiConfig

from agentkv.kernels import PagedKV, RopeParams, Span, apply_plan, build_plan, evict_spans, move_tokens
from agentkv.kernels.evict_loop import rotate_complex
from agentkv.kernels.rope import rotate

from kernel_reference import expected_moves, hf_rotate, write_expected

BACKENDS = ["torch", "loop", "triton"]
# (dtype, atol, rtol): the kernels round once from float32 math, the oracle once from float64.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-3, 1e-3), (torch.bfloat16, 1e-2, 1.6e-2)]
LAYOUTS = ["flash", "cpu"]


def new_raw(layout: str, blocks: int, block_size: int, heads: int, head_dim: int, dtype, gen=None) -> torch.Tensor:
    """A layer's whole KV buffer as vLLM allocates it (random bytes, or zeros without ``gen``)."""
    shape = (2, blocks, block_size, heads, head_dim) if layout == "flash" else (blocks, heads, block_size, 2 * head_dim)
    return (torch.randn(shape, generator=gen) if gen is not None else torch.zeros(shape)).to(dtype)


def view(raw: torch.Tensor, layout: str) -> PagedKV:
    return PagedKV.from_flash(raw) if layout == "flash" else PagedKV.from_cpu(raw)


@dataclass
class Case:
    """Source (and, with a different block size, destination) buffers per layer, before the call."""

    layout: str
    src: list[torch.Tensor]
    dst: list[torch.Tensor] | None       # None: the destination is the source cache itself
    src_bt: torch.Tensor
    dst_bt: torch.Tensor
    rope: RopeParams
    spans: list[Span]
    src_len: int
    replacement: list[PagedKV]


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    src_len = draw(st.integers(1, 48))
    cuts = sorted(draw(st.lists(st.integers(0, src_len), min_size=0, max_size=6)))
    spans = [Span(a, b, draw(st.integers(0, 3))) for a, b in zip(cuts[::2], cuts[1::2])]
    spans = [s for s in spans if s.end > s.start or s.replacement]
    dst_block_size = draw(st.sampled_from([None, 1, 4, 16]))   # None: same cache, other blocks or in place
    head_dim = draw(st.sampled_from([64, 96, 128]))
    return dict(block_size=block_size, dst_block_size=dst_block_size, src_len=src_len, spans=spans,
                layers=draw(st.sampled_from([1, 2])), heads=draw(st.sampled_from([1, 2, 3, 8])),
                head_dim=head_dim, rotary_dim=draw(st.sampled_from([head_dim, head_dim // 2, head_dim // 4])),
                is_neox=draw(st.booleans()), layout=draw(st.sampled_from(LAYOUTS)),
                in_place=dst_block_size is None and draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_case(sc: dict, dtype) -> Case:
    gen = torch.Generator().manual_seed(sc["seed"])
    bs, dbs = sc["block_size"], sc["dst_block_size"] or sc["block_size"]
    n_src = -(-sc["src_len"] // bs)
    dst_len = sc["src_len"] + sum(s.delta for s in sc["spans"])
    n_dst = max(1, -(-dst_len // dbs))
    shape = (sc["heads"], sc["head_dim"])
    if sc["dst_block_size"] is None:
        blocks = n_src + n_dst + 2
        perm = torch.randperm(blocks, generator=gen)
        src_bt, dst_bt = perm[:n_src], (perm[:n_dst] if sc["in_place"] else perm[n_src:n_src + n_dst])
        dst = None
    else:
        blocks = n_src + 2
        src_bt = torch.randperm(blocks, generator=gen)[:n_src]
        dst_bt = torch.randperm(n_dst + 3, generator=gen)[:n_dst]
        dst = [new_raw(sc["layout"], n_dst + 3, dbs, *shape, dtype, gen) for _ in range(sc["layers"])]
    src = [new_raw(sc["layout"], blocks, bs, *shape, dtype, gen) for _ in range(sc["layers"])]
    n_rep = sum(s.replacement for s in sc["spans"])
    replacement = [PagedKV.from_rows(torch.randn(n_rep, *shape, generator=gen).to(dtype),
                                     torch.randn(n_rep, *shape, generator=gen).to(dtype)) for _ in range(sc["layers"])]
    rope = RopeParams.default(sc["head_dim"], 10000.0, sc["rotary_dim"], sc["is_neox"])
    return Case(sc["layout"], src, dst, src_bt, dst_bt, rope, sc["spans"], sc["src_len"], replacement)


def run_backend(case: Case, backend: str):
    """The kernel's result: every layer's whole source and destination buffers after ``evict_spans``."""
    src = [r.clone() for r in case.src]
    dst = [r.clone() for r in case.dst] if case.dst is not None else None
    plan = evict_spans([view(r, case.layout) for r in src], case.src_bt, case.src_len, case.spans, case.dst_bt,
                       case.rope, replacement=case.replacement,
                       dst_layers=[view(r, case.layout) for r in dst] if dst is not None else None, backend=backend)
    return plan, src, dst


def run_oracle(case: Case):
    """The expected whole buffers, from the reference (untouched source bytes stay as they were)."""
    src = [r.clone() for r in case.src]
    dst = [r.clone() for r in case.dst] if case.dst is not None else src
    moves, rep_slots = expected_moves(case.src_len, case.spans, case.src_bt, case.dst_bt,
                                      view(src[0], case.layout).block_size, view(dst[0], case.layout).block_size)
    for i in range(len(src)):
        write_expected(view(case.src[i], case.layout), view(dst[i], case.layout), moves, case.rope,
                       case.replacement[i], rep_slots)
    return src, (dst if case.dst is not None else None), moves


def assert_whole_buffers(got: list[torch.Tensor], want: list[torch.Tensor], layout: str, atol, rtol) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)                        # every byte of the layer
        assert torch.equal(view(g, layout).value, view(w, layout).value)               # V is copied, never rounded


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES, ids=["fp32", "fp16", "bf16"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_evict_spans_matches_reference_on_whole_caches(sc, backend, dtype, atol, rtol):
    case = make_case(sc, dtype)
    plan, src, dst = run_backend(case, backend)
    want_src, want_dst, moves = run_oracle(case)
    assert plan.dst_len == case.src_len + sum(s.delta for s in case.spans)
    assert plan.kept_positions.numel() == len(moves)
    if dst is None:
        assert_whole_buffers(src, want_src, case.layout, atol, rtol)
    else:
        assert all(torch.equal(a, b) for a, b in zip(src, case.src))                  # source never written
        assert_whole_buffers(dst, want_dst, case.layout, atol, rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["gptj", "phi"])
def test_gptj_pairs_and_partial_rotary_match_transformers(backend, model):
    """head_dim 96, rotary on half of it, pairing from the model's own config: GPT-J interleaved
    pairs, Phi NeoX halves; source block 16, destination block 4 in another cache, two layers."""
    cfg = (GPTJConfig(n_embd=192, n_head=2, rotary_dim=48) if model == "gptj"
           else PhiConfig(hidden_size=192, num_attention_heads=2, partial_rotary_factor=0.5))
    rope = RopeParams.from_hf_config(cfg)
    assert (rope.head_dim, rope.rotary_dim, rope.is_neox) == (96, 48, model == "phi")
    gen = torch.Generator().manual_seed(5)
    src = [new_raw("flash", 6, 16, 2, 96, torch.float32, gen) for _ in range(2)]
    dst = [new_raw("cpu", 24, 4, 2, 96, torch.float32, gen) for _ in range(2)]
    rep = [PagedKV.from_rows(torch.randn(2, 2, 96, generator=gen), torch.randn(2, 2, 96, generator=gen))
           for _ in range(2)]
    spans = [Span(3, 20, 2), Span(41, 47)]
    src_bt, dst_bt = torch.tensor([4, 0, 5, 2]), torch.tensor([9, 3, 17, 0, 12, 6, 21, 14, 1, 20, 7])
    got = [r.clone() for r in dst]
    evict_spans([view(r, "flash") for r in src], src_bt, 60, spans, dst_bt, rope, replacement=rep,
                dst_layers=[view(r, "cpu") for r in got], backend=backend)
    moves, rep_slots = expected_moves(60, spans, src_bt, dst_bt, 16, 4)
    want = [r.clone() for r in dst]
    for i in range(2):
        write_expected(view(src[i], "flash"), view(want[i], "cpu"), moves, rope, rep[i], rep_slots)
    assert_whole_buffers(got, want, "cpu", 1e-5, 1e-5)
    other = RopeParams.default(96, 10000.0, 48, not rope.is_neox)           # the wrong pairing is seen
    wrong = [r.clone() for r in dst]
    write_expected(view(src[0], "flash"), view(wrong[0], "cpu"), moves, other, rep[0], rep_slots)
    assert (view(got[0], "cpu").key - view(wrong[0], "cpu").key).abs().max() > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same_cache", [False, True])
def test_move_tokens_with_per_token_deltas(backend, same_cache):
    """move_tokens directly: scattered slots, a different delta for each token, GPT-J pairs with
    partial rotary; into another cache of another block size, or into disjoint slots of the same."""
    gen = torch.Generator().manual_seed(11)
    rope = RopeParams.default(96, 500000.0, 64, is_neox=False)
    src_raw = new_raw("cpu", 12, 8, 3, 96, torch.bfloat16, gen)
    dst_raw = src_raw if same_cache else new_raw("flash", 40, 2, 3, 96, torch.bfloat16, gen)
    n = 29
    order = torch.randperm(96, generator=gen)
    src_slots = order[:n]
    dst_slots = order[n:2 * n] if same_cache else torch.randperm(80, generator=gen)[:n]
    deltas = torch.randint(-40000, 40000, (n,), generator=gen)
    before_src, before_dst = src_raw.clone(), dst_raw.clone()
    move_tokens(view(src_raw, "cpu"), view(dst_raw, "cpu" if same_cache else "flash"), src_slots, dst_slots,
                deltas, rope, backend=backend)
    want = before_src.clone() if same_cache else before_dst.clone()
    want_view = view(want, "cpu" if same_cache else "flash")
    src_view = view(before_src, "cpu")
    k = src_view.key[src_slots // 8, src_slots % 8]
    bs = want_view.block_size
    want_view.key[dst_slots // bs, dst_slots % bs] = hf_rotate(k, deltas, rope).to(torch.bfloat16)
    want_view.value[dst_slots // bs, dst_slots % bs] = src_view.value[src_slots // 8, src_slots % 8]
    torch.testing.assert_close(dst_raw, want, atol=1e-2, rtol=1.6e-2)
    if not same_cache:
        assert torch.equal(src_raw, before_src)


@settings(max_examples=40, deadline=None)
@given(sc=scenarios())
def test_plan_maps_kept_tokens_in_order_around_replacements(sc):
    bt = torch.arange(64)
    plan = build_plan(sc["src_len"], sc["spans"], bt, bt, sc["block_size"], skip_unmoved=False)
    moves, rep_slots = expected_moves(sc["src_len"], sc["spans"], bt, bt, sc["block_size"], sc["block_size"])
    assert plan.src_slots.tolist() == [m[0] for m in moves]
    assert plan.dst_slots.tolist() == [m[1] for m in moves]
    assert plan.deltas[plan.seg.long()].tolist() == [m[2] for m in moves]
    assert plan.replacement_slots.tolist() == rep_slots
    both = torch.cat([plan.new_positions, plan.replacement_positions]).sort().values
    assert torch.equal(both, torch.arange(plan.dst_len))       # every new position filled once
    assert bool((plan.new_positions.diff() > 0).all())          # kept tokens keep their order


@pytest.mark.parametrize("backend", BACKENDS)
def test_spans_at_start_end_and_across_blocks(backend):
    sc = dict(block_size=4, dst_block_size=None, src_len=30, spans=[Span(0, 3), Span(6, 13, 1), Span(27, 30)],
              layers=1, heads=2, head_dim=64, rotary_dim=64, is_neox=True, layout="cpu", in_place=True, seed=3)
    case = make_case(sc, torch.float32)
    plan, src, _ = run_backend(case, backend)
    want, _, _ = run_oracle(case)
    assert plan.dst_len == 30 - 3 - 7 + 1 - 3
    assert_whole_buffers(src, want, "cpu", 1e-5, 1e-5)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_rotation_composes(is_neox, rotary_dim):
    rope = RopeParams.default(128, 500000.0, rotary_dim, is_neox)
    x = torch.randn(5, 4, 128, dtype=torch.float64).float()
    a, b = torch.tensor([37, -1000, 5]), torch.tensor([-12, 77, 100000])
    ca, sa = rope.cos_sin(a, "cpu")
    cb, sb = rope.cos_sin(b, "cpu")
    cab, sab = rope.cos_sin(a + b, "cpu")
    for turn in (rotate, rotate_complex):
        for i in range(3):
            twice = turn(turn(x, ca[i], sa[i], rope), cb[i], sb[i], rope)
            torch.testing.assert_close(twice, turn(x, cab[i], sab[i], rope), atol=2e-5, rtol=1e-5)
        c0, s0 = rope.cos_sin(torch.tensor([0]), "cpu")
        assert torch.equal(turn(x, c0[0], s0[0], rope), x)


def test_overlapping_spans_rejected():
    with pytest.raises(ValueError, match="overlap"):
        build_plan(10, [Span(1, 5), Span(4, 6)], torch.arange(4), torch.arange(4), 4)
    with pytest.raises(ValueError, match="blocks"):
        build_plan(10, [Span(1, 2, 5)], torch.arange(3), torch.arange(3), 4)


def test_cpu_layout_views_match_vllm_storage():
    """K of a block/head is stored transposed ([head_dim, block_size]), V as rows."""
    nb, h, bs, d = 2, 3, 4, 8
    raw = torch.arange(nb * h * bs * 2 * d, dtype=torch.float32).view(nb, h, bs, 2 * d)
    kv = PagedKV.from_cpu(raw)
    flat = raw.view(nb, h, 2 * bs * d)
    for b, o, hh, j in [(0, 0, 0, 0), (1, 3, 2, 7), (0, 2, 1, 5)]:
        assert kv.key[b, o, hh, j] == flat[b, hh, j * bs + o]
        assert kv.value[b, o, hh, j] == flat[b, hh, bs * d + o * d + j]


def test_mismatched_kernel_inputs_are_refused():
    rope = RopeParams.default(64)
    a = view(new_raw("flash", 4, 4, 2, 64, torch.float32), "flash")
    b = view(new_raw("flash", 4, 4, 2, 64, torch.float32), "flash")
    three_heads = view(new_raw("flash", 4, 4, 3, 64, torch.float32), "flash")
    with pytest.raises(ValueError, match="one each per token"):
        move_tokens(a, b, torch.arange(3), torch.arange(2), torch.zeros(3, dtype=torch.int64), rope)
    with pytest.raises(ValueError, match="destination heads x head_dim 3 x 64 != source 2 x 64"):
        move_tokens(a, three_heads, torch.arange(2), torch.arange(2), torch.zeros(2, dtype=torch.int64), rope)
    # a plan that left out unmoved tokens (same slot ids) is only valid within one cache
    plan = build_plan(8, [Span(5, 6)], torch.arange(2), torch.arange(2), 4)
    with pytest.raises(ValueError, match="within one cache only"):
        apply_plan([a], plan, rope, dst_layers=[b])
