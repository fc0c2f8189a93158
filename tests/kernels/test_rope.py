"""RopeParams.from_hf_config takes the rotary pairing from the model: every architecture it accepts is
checked against transformers' own model (a 1-layer random model: its layer-0 keys at positions p,
re-rotated by the derived parameters, equal its keys at p + delta; the other pairing does not)."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig

from agentkv.kernels import RopeParams, UnsupportedShift
from agentkv.kernels.rope import PAIRING, rotate

TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
            num_hidden_layers=1, vocab_size=256, max_position_embeddings=4096,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
EXTRA = {  # what a tiny config of the architecture needs besides TINY
    "mistral": {"sliding_window": None},
    "gptj": {"rotary_dim": 32},                                  # partial rotary, interleaved
    "codegen": {"rotary_dim": 32, "num_attention_heads": 4, "hidden_size": 256},   # qkv split in 4
}


def layer0_keys(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True)
    return out.past_key_values.layers[0].keys[0].transpose(0, 1)      # [T, kv_heads, head_dim]


@pytest.mark.parametrize("model_type", sorted(PAIRING) + ["gptj", "codegen"])
def test_pairing_matches_the_models_own_rotary(model_type):
    cfg = CONFIG_MAPPING[model_type](**(TINY | EXTRA.get(model_type, {})))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    rope = RopeParams.from_hf_config(cfg)
    ids = torch.randint(3, 256, (12,)).tolist()
    p = list(range(20, 32))
    delta = 1234
    before, after = layer0_keys(model, ids, p), layer0_keys(model, ids, [x + delta for x in p])
    assert rope.head_dim == after.shape[-1]
    cos, sin = rope.cos_sin(torch.tensor([delta]), "cpu")
    torch.testing.assert_close(rotate(before, cos[0], sin[0], rope), after, atol=1e-4, rtol=1e-4)
    flipped = RopeParams(rope.inv_freq, rope.head_dim, not rope.is_neox)
    assert (rotate(before, cos[0], sin[0], flipped) - after).abs().max() > 0.1


@pytest.mark.parametrize("model_type, expected", [
    ("gptj", (64, 32, False)), ("codegen", (64, 32, False)), ("glm", (128, 64, False)),
    ("cohere", (64, 64, False)), ("phi", (64, 32, True)), ("gpt_neox", (64, 16, True)), ("llama", (64, 64, True)),
])
def test_derived_head_and_rotary_dims(model_type, expected):
    rope = RopeParams.from_hf_config(CONFIG_MAPPING[model_type](**(TINY | EXTRA.get(model_type, {}))))
    assert (rope.head_dim, rope.rotary_dim, rope.is_neox) == expected


@pytest.mark.parametrize("original_rope, rope_ratio, is_neox", [(True, 1.0, False), (False, 500.0, True)])
def test_chatglm_as_vllm_builds_it(original_rope, rope_ratio, is_neox):
    """vLLM's chatglm.py: rotary on half of head_dim, theta 10000 * rope_ratio, neox = not original_rope."""
    cfg = PretrainedConfig(hidden_size=4096, num_attention_heads=32, original_rope=original_rope,
                           rope_ratio=rope_ratio)
    cfg.model_type = "chatglm"
    rope = RopeParams.from_hf_config(cfg)
    assert (rope.head_dim, rope.rotary_dim, rope.is_neox) == (128, 64, is_neox)
    want = 1.0 / (10000.0 * rope_ratio) ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(rope.inv_freq, want.float())


@pytest.mark.parametrize("model_type, extra, reason", [
    ("gpt2", {}, "pairing not known"),                 # learned absolute positions, no RoPE
    ("bloom", {}, "pairing not known"),                # ALiBi
    ("llama4_text", {}, "pairing not known"),          # NoPE layers
    ("smollm3", {}, "pairing not known"),              # NoPE layers
    ("qwen2_vl_text", {}, "pairing not known"),        # multimodal (mrope) positions
    ("falcon", {"alibi": True}, "ALiBi"),
    ("chatglm", {}, "original_rope"),
])
def test_unknown_or_positionless_architectures_are_refused(model_type, extra, reason):
    if model_type == "chatglm":
        cfg = PretrainedConfig(hidden_size=256, num_attention_heads=2)
        cfg.model_type = "chatglm"
    else:
        cfg = CONFIG_MAPPING[model_type](**extra)
    with pytest.raises(UnsupportedShift, match=reason):
        RopeParams.from_hf_config(cfg)
