"""The tiny test model: a random-weight Llama with a locally trained tokenizer.

Real architecture, real vLLM code path, no download, builds in seconds; its answers are noise (use
it for protocol tests and the 1-layer exactness tests). Fixed seed: the same files, byte for byte,
on every build (``manifest.json`` lists their SHA-256).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .artifact import build_dir
from .tokenizer import train_tokenizer


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the embedded model. head_dim must be one the vLLM CPU attention backend supports."""

    layers: int = 2
    hidden_size: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 2048
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    initializer_range: float = 0.08
    seed: int = 1234
    # Random weights almost never emit the end-of-turn token (about 4e-4 a step), so every answer
    # runs to max_tokens, which agent clients report as an error. With eos_weight > 0 every token
    # embedding gets a constant component and the end-of-turn row of the output layer a weight on
    # it: the turn then ends with about 0.1-0.2 probability a step (3.5), as a chat model's do.
    eos_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError("layers must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")

    @property
    def name(self) -> str:
        return f"agentkv-tiny-{self.layers}l"


def _write(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
    pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(pad_token_id, int)   # one token's string converts to one id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"},   # what rope_theta= becomes
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    if spec.eos_weight:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += 1.0
            model.lm_head.weight[config.eos_token_id, 0] = spec.eos_weight
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "agentkv_spec.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")


def build_model(out: Path, spec: TinyModelSpec = TinyModelSpec(), force: bool = False) -> Path:
    """Write the tiny model to ``out`` (atomically: a half-built directory is never left behind)."""
    return build_dir(Path(out), lambda tmp: _write(spec, tmp), force)
