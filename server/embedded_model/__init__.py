"""The embedded default model (tiny, random weights, built locally)."""

from .build import TinyModelSpec, build_model, is_built

__all__ = ["TinyModelSpec", "build_model", "is_built"]
