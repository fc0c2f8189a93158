"""evict_spans: Triton (interpreted on CPU) equals the torch reference equals a per-token loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.kernels import PagedKV, RopeParams, Span, build_plan, evict_spans
from agentkv.kernels.rope import rotate

DTYPES = [(torch.float32, 1e-6, 1e-5), (torch.float16, 1e-3, 1e-3), (torch.bfloat16, 1e-2, 1e-2)]
LAYOUTS = ["flash", "cpu"]


def make_cache(layout: str, blocks: int, block_size: int, heads: int, head_dim: int, dtype, gen) -> PagedKV:
    if layout == "flash":
        return PagedKV.from_flash(torch.randn(2, blocks, block_size, heads, head_dim, generator=gen).to(dtype))
    return PagedKV.from_cpu(torch.randn(blocks, heads, block_size, 2 * head_dim, generator=gen).to(dtype))


def clone(kv: PagedKV, layout: str) -> PagedKV:
    """A deep copy in a fresh buffer of the same layout (views into one storage, as in vLLM)."""
    nb, bs, h, d = kv.key.shape
    if layout == "flash":
        out = PagedKV.from_flash(torch.empty(2, nb, bs, h, d, dtype=kv.key.dtype))
    else:
        out = PagedKV.from_cpu(torch.empty(nb, h, bs, 2 * d, dtype=kv.key.dtype))
    out.key.copy_(kv.key)
    out.value.copy_(kv.value)
    return out


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    src_len = draw(st.integers(1, 48))
    cuts = sorted(draw(st.lists(st.integers(0, src_len), min_size=0, max_size=6)))
    spans = [Span(a, b, draw(st.integers(0, 3))) for a, b in zip(cuts[::2], cuts[1::2])]
    spans = [s for s in spans if s.end > s.start or s.replacement]
    return dict(block_size=block_size, src_len=src_len, spans=spans,
                heads=draw(st.sampled_from([1, 2, 3, 8])), head_dim=draw(st.sampled_from([64, 128])),
                rotary_frac=draw(st.sampled_from([1.0, 0.5, 0.25])), is_neox=draw(st.booleans()),
                layout=draw(st.sampled_from(LAYOUTS)), seed=draw(st.integers(0, 2**16)))


def run(sc: dict, dtype, backend: str, in_place: bool = False):
    gen = torch.Generator().manual_seed(sc["seed"])
    bs = sc["block_size"]
    n_src = -(-sc["src_len"] // bs)
    dst_len = sc["src_len"] + sum(s.delta for s in sc["spans"])
    n_dst = max(1, -(-dst_len // bs))
    blocks = n_src + n_dst + 2
    perm = torch.randperm(blocks, generator=gen)
    src_bt, dst_bt = perm[:n_src], (perm[:n_dst] if in_place else perm[n_src:n_src + n_dst])
    cache = make_cache(sc["layout"], blocks, bs, sc["heads"], sc["head_dim"], dtype, gen)
    rope = RopeParams.default(sc["head_dim"], 10000.0, int(sc["head_dim"] * sc["rotary_frac"]), sc["is_neox"])
    n_rep = sum(s.replacement for s in sc["spans"])
    rep = PagedKV.from_rows(torch.randn(n_rep, sc["heads"], sc["head_dim"], generator=gen).to(dtype),
                            torch.randn(n_rep, sc["heads"], sc["head_dim"], generator=gen).to(dtype))
    out = clone(cache, sc["layout"])
    plan = evict_spans(out, src_bt, sc["src_len"], sc["spans"], dst_bt, rope, replacement=[rep], backend=backend)
    return out, plan, dst_bt


def read(kv: PagedKV, block_table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n)
    b, o = block_table[pos // kv.block_size], pos % kv.block_size
    return kv.key[b, o], kv.value[b, o]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_triton_matches_torch_reference(sc, dtype, atol, rtol):
    ref, plan, dst_bt = run(sc, dtype, "torch")
    tri, _, _ = run(sc, dtype, "triton")
    for a, b in zip(read(tri, dst_bt, plan.dst_len), read(ref, dst_bt, plan.dst_len)):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@settings(max_examples=40, deadline=None)
@given(sc=scenarios())
def test_torch_reference_matches_per_token_loop(sc):
    ref, plan, dst_bt = run(sc, torch.float32, "torch")
    loop, _, _ = run(sc, torch.float32, "loop")
    for a, b in zip(read(ref, dst_bt, plan.dst_len), read(loop, dst_bt, plan.dst_len)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=15, deadline=None)
@given(sc=scenarios())
def test_in_place_compaction_equals_out_of_place(sc, backend):
    out, plan, dst_bt = run(sc, torch.float32, backend)
    inp, plan_in, dst_in = run(sc, torch.float32, backend, in_place=True)
    assert plan_in.dst_len == plan.dst_len
    for a, b in zip(read(inp, dst_in, plan.dst_len), read(out, dst_bt, plan.dst_len)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(sc=scenarios())
def test_plan_maps_kept_tokens_in_order_around_replacements(sc):
    bt = torch.arange(64)
    plan = build_plan(sc["src_len"], sc["spans"], bt, bt, sc["block_size"], skip_unmoved=False)
    dropped = sum(s.end - s.start for s in sc["spans"])
    assert plan.kept_positions.numel() == sc["src_len"] - dropped
    both = torch.cat([plan.new_positions, plan.replacement_positions]).sort().values
    assert torch.equal(both, torch.arange(plan.dst_len))       # every new position filled once
    assert bool((plan.new_positions.diff() > 0).all())          # kept tokens keep their order


def test_spans_at_start_end_and_across_blocks():
    sc = dict(block_size=4, src_len=30, spans=[Span(0, 3), Span(6, 13, 1), Span(27, 30)], heads=2,
              head_dim=64, rotary_frac=1.0, is_neox=True, layout="cpu", seed=3)
    out, plan, dst_bt = run(sc, torch.float32, "triton")
    ref, _, _ = run(sc, torch.float32, "loop")
    assert plan.dst_len == 30 - 3 - 7 + 1 - 3
    torch.testing.assert_close(read(out, dst_bt, plan.dst_len)[0], read(ref, dst_bt, plan.dst_len)[0])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_rotation_composes(is_neox, rotary_dim):
    rope = RopeParams.default(128, 500000.0, rotary_dim, is_neox)
    x = torch.randn(5, 4, 128, dtype=torch.float64).float()
    a, b = torch.tensor([37, -1000, 5]), torch.tensor([-12, 77, 100000])
    ca, sa = rope.cos_sin(a, "cpu")
    cb, sb = rope.cos_sin(b, "cpu")
    cab, sab = rope.cos_sin(a + b, "cpu")
    for i in range(3):
        twice = rotate(rotate(x, ca[i], sa[i], rope), cb[i], sb[i], rope)
        torch.testing.assert_close(twice, rotate(x, cab[i], sab[i], rope), atol=2e-5, rtol=1e-5)
    c0, s0 = rope.cos_sin(torch.tensor([0]), "cpu")
    assert torch.equal(rotate(x, c0[0], s0[0], rope), x)


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
