"""Which models need vLLM's hybrid KV cache manager, read from their config.json, and what the
server then does with retention (the connector would turn that manager off)."""

from __future__ import annotations

import json

import pytest

from agentkv.server.config import ServeConfig
from agentkv.server.engine.hybrid import hybrid_reason, model_config, without_retention

# the relevant fields of real configs (hub files of these models)
LLAMA_3 = {"model_type": "llama", "num_hidden_layers": 32}
QWEN_2_5 = {"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}
MISTRAL_V01 = {"model_type": "mistral", "sliding_window": 4096}
GEMMA_3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "sliding_window": 1024,
                                                   "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}
GPT_OSS = {"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"] * 12,
           "sliding_window": 128}
JAMBA = {"model_type": "jamba", "attn_layer_period": 8}
NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-M"}
QWEN_3 = {"model_type": "qwen3", "sliding_window": None, "use_sliding_window": False,
          "layer_types": ["full_attention"] * 28}


@pytest.mark.parametrize("config", [LLAMA_3, QWEN_2_5, QWEN_3], ids=["llama-3", "qwen-2.5", "qwen-3"])
def test_full_attention_models_do_not(config):
    assert hybrid_reason(config) is None


@pytest.mark.parametrize("config, words", [(MISTRAL_V01, "sliding-window attention (4096"),
                                           (GEMMA_3, "sliding_attention"), (GPT_OSS, "sliding_attention"),
                                           (JAMBA, "jamba mixes"), (NEMOTRON_H, "nemotron_h mixes")],
                         ids=["mistral-v0.1", "gemma-3", "gpt-oss", "jamba", "nemotron-h"])
def test_sliding_window_and_hybrid_models_do(config, words):
    assert words in hybrid_reason(config)


def test_the_config_is_read_from_a_folder_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS))
    assert model_config(str(tmp_path)) == GPT_OSS
    assert model_config(str(tmp_path / "config.json")) is None               # a file (GGUF): none
    assert model_config("no-such-org/no-such-model-here") is None             # not cached: no network
    (tmp_path / "config.json").write_text("{not json")
    assert model_config(str(tmp_path)) is None


def test_retention_alone_is_off_on_such_a_model_on_a_gpu_only(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_3))
    cfg = ServeConfig(model=str(tmp_path))
    assert cfg.kv_retention and cfg.kv_connector
    off = without_retention(cfg, str(tmp_path), "cuda")
    assert not off.kv_retention and not off.kv_connector
    assert "KV retention is off" in caplog.text and "sliding_attention" in caplog.text
    assert without_retention(cfg, str(tmp_path), "cpu") is cfg              # vLLM has no hybrid manager there
    shift = ServeConfig(model=str(tmp_path), kv_reuse="shift")
    assert without_retention(shift, str(tmp_path), "cuda") is shift          # asked for a mode that moves K/V
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3))
    assert without_retention(cfg, str(tmp_path), "cuda") is cfg
