"""The embedded model: deterministic, loads in transformers, chat template renders every role."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentkv.server.embedded_model import TinyModelSpec, build_model

MESSAGES = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny")


def test_build_is_byte_for_byte_deterministic(model_dir, tmp_path):
    again = build_model(tmp_path / "again")
    assert (again / "manifest.json").read_bytes() == (model_dir / "manifest.json").read_bytes()
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(manifest)


def test_loads_in_transformers_and_generates(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    spec = TinyModelSpec()
    assert model.config.num_hidden_layers == spec.layers and len(tok) == spec.vocab_size
    ids = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_chat_template_renders_all_roles_and_tool_calls(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are an agent.\n\n# Tools")
    assert '"name": "get_weather"' in text.split("</tools>\n")[0]
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call><|im_end|>\n') in text
    assert "<|im_start|>tool\n<tool_response>sunny, 21 C</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The hermes parser needs the markers as single tokens, and decoding must keep them.
    ids = tok.encode("<tool_call>{}</tool_call>")
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_one_layer_variant(tmp_path):
    out = build_model(tmp_path / "one", TinyModelSpec(layers=1))
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_spec_rejects_bad_shapes():
    with pytest.raises(ValueError):
        TinyModelSpec(layers=0)
    with pytest.raises(ValueError):
        TinyModelSpec(heads=4, kv_heads=3)
