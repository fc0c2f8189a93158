"""Layer 0 is position-shift exact: moving cached K/V equals recomputing the edited sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from agentkv.kernels import PagedKV, RopeParams, Span, UnsupportedShift, evict_spans
from agentkv.server.embedded_model import TinyModelSpec, build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_model(tmp_path_factory.mktemp("m1") / "tiny-1l", TinyModelSpec(layers=1))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def layer0_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE K and V of layer 0, ``[T, kv_heads, head_dim]``."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    layer = cache.layers[0]
    return layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_shifted_kv_equals_recomputed_kv_at_layer0(model, backend, layout):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(10, 2000, (300,), generator=gen).tolist()
    placeholder = [11, 12, 13, 14, 15]
    spans = [Span(40, 120, len(placeholder)), Span(200, 230)]
    edited = ids[:40] + placeholder + ids[120:200] + ids[230:]
    k_src, v_src = layer0_kv(model, ids)
    k_new, v_new = layer0_kv(model, edited)

    cfg = model.config
    rope = RopeParams.from_hf_config(cfg)
    bs, heads, hd = 32, cfg.num_key_value_heads, cfg.head_dim
    blocks = 24
    if layout == "cpu":
        kv = PagedKV.from_cpu(torch.zeros(blocks, heads, bs, 2 * hd))
    else:
        kv = PagedKV.from_flash(torch.zeros(2, blocks, bs, heads, hd))
    src_bt = torch.randperm(blocks, generator=gen)[:10]
    dst_bt = torch.tensor([b for b in range(blocks) if b not in set(src_bt.tolist())][:10])
    pos = torch.arange(len(ids))
    kv.key[src_bt[pos // bs], pos % bs] = k_src
    kv.value[src_bt[pos // bs], pos % bs] = v_src

    rep_pos = torch.arange(40, 40 + len(placeholder))
    replacement = PagedKV.from_rows(k_new[rep_pos], v_new[rep_pos])
    plan = evict_spans(kv, src_bt, len(ids), spans, dst_bt, rope, replacement=[replacement], backend=backend)
    assert plan.dst_len == len(edited)
    # The whole cache: source blocks keep the old K/V, destination blocks hold the recomputed K/V of
    # the edited sequence, every other slot stays zero.
    want = PagedKV(torch.zeros_like(kv.key), torch.zeros_like(kv.value))
    want.key[src_bt[pos // bs], pos % bs] = k_src
    want.value[src_bt[pos // bs], pos % bs] = v_src
    q = torch.arange(len(edited))
    want.key[dst_bt[q // bs], q % bs] = k_new
    want.value[dst_bt[q // bs], q % bs] = v_new
    torch.testing.assert_close(kv.value, want.value, atol=0, rtol=0)
    # fp32: the model itself rounds each absolute angle p*inv_freq to float32.
    torch.testing.assert_close(kv.key, want.key, atol=2e-5, rtol=1e-4)


ROPE_CONFIGS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
]


@pytest.mark.parametrize("rope_parameters", ROPE_CONFIGS, ids=lambda p: p["rope_type"])
def test_shift_matches_transformers_rope_for_scaled_variants(rope_parameters):
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=131072, rope_parameters=dict(rope_parameters))
    hf = LlamaRotaryEmbedding(cfg)
    rope = RopeParams.from_hf_config(cfg)
    torch.testing.assert_close(rope.inv_freq, hf.inv_freq.float())
    x = torch.randn(1, 2, 6, 128)
    p = torch.tensor([[0, 5, 100, 1000, 4000, 9000]])
    delta = torch.tensor([-3, 17, -90, 2000, -3999, 500])

    def hf_at(positions):
        cos, sin = hf(x, positions)
        return apply_rotary_pos_emb(x, x, cos, sin)[1]

    cos_d, sin_d = rope.cos_sin(delta, "cpu")
    from agentkv.kernels.rope import rotate

    moved = rotate(hf_at(p)[0].transpose(0, 1), cos_d[:, None], sin_d[:, None], rope)
    # YaRN's attention factor is inside the cached key once and must not be applied again.
    # transformers rounds each absolute angle to float32: error up to ~|p| * 6e-8 rad (9500 -> 6e-4).
    torch.testing.assert_close(moved, hf_at(p + delta)[0].transpose(0, 1), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("extra, reason", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "sequence length"),
    ({"sliding_window": 4096}, "sliding-window"),
])
def test_unsupported_shifts_are_refused(extra, reason):
    from transformers import MistralConfig

    cls = MistralConfig if "sliding_window" in extra else LlamaConfig
    cfg = cls(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128, **extra)
    with pytest.raises(UnsupportedShift, match=reason):
        RopeParams.from_hf_config(cfg)
