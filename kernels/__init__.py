"""agentkv.kernels: KV-cache eviction kernels (Triton) and their torch references.

Installed as ``agentkv.kernels`` (see pyproject.toml), never as a top-level ``kernels``, so
transformers' probe for the unrelated PyPI package ``kernels`` cannot find it in an installed
environment. It defines no ``__version__`` on purpose: even where a working directory puts this
folder on sys.path as ``kernels``, that probe reads "no version" and reports the package absent.

Two parts: the pure torch/Triton kernels (``evict``, ``evict_torch``, ``evict_triton``, ``evict_loop``,
``layout``, ``plan``, ``rope``) and the vLLM KV connector that uses them (``connector``). The names
below load on first use, so importing ``agentkv.kernels.connector.params`` (the front does) pulls in
neither torch nor Triton.
"""

import importlib

_WHERE = {"apply_plan": "evict", "evict_spans": "evict", "move_tokens": "evict", "PagedKV": "layout",
          "slots_of": "layout", "EvictionPlan": "plan", "Span": "plan", "build_plan": "plan",
          "RopeParams": "rope", "UnsupportedShift": "rope"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
