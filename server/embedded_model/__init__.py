"""Models agentkv builds itself: the default SmolLM2-135M-Instruct and the tiny random test model.
Heavy modules (transformers) load only when a model is built."""

from .names import DEFAULT_MODEL, SMOLLM2, TINY, is_embedded, tiny_layers

__all__ = ["DEFAULT_MODEL", "SMOLLM2", "TINY", "TinyModelSpec", "build_model", "is_built", "is_embedded",
           "tiny_layers"]


def __getattr__(name: str):
    if name in ("TinyModelSpec", "build_model"):
        from . import build

        return getattr(build, name)
    if name == "is_built":
        from .artifact import is_built

        return is_built
    raise AttributeError(name)
