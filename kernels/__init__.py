"""agentkv.kernels: KV-cache eviction kernels (Triton) and their torch references.

Installed as ``agentkv.kernels`` (see pyproject.toml), never as a top-level ``kernels``, so
transformers' probe for the unrelated PyPI package ``kernels`` cannot find it in an installed
environment. It defines no ``__version__`` on purpose: even where a working directory puts this
folder on sys.path as ``kernels``, that probe reads "no version" and reports the package absent.
"""

from .evict import apply_plan, evict_spans, move_tokens
from .layout import PagedKV, slots_of
from .plan import EvictionPlan, Span, build_plan
from .rope import RopeParams, UnsupportedShift

__all__ = ["EvictionPlan", "PagedKV", "RopeParams", "Span", "UnsupportedShift", "apply_plan",
           "build_plan", "evict_spans", "move_tokens", "slots_of"]
