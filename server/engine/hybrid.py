"""Whether a model needs vLLM's hybrid KV cache manager (HMA).

vLLM turns that manager off whenever ``--kv-transfer-config`` names a connector without
``SupportsHMA``, agentkv's included: a model with sliding-window layers then keeps a whole
window's K/V for every layer (memory lost to the pool), and a hybrid of attention and state-space
or linear-attention layers fails at start. Retention alone is not worth either, so on such a model
the server does not load the connector for it (``without_retention``); a mode that moves K/V
(shift, blend) still asks for it. On the CPU vLLM has no hybrid manager at all, so nothing changes there.
Reads the model's ``config.json`` only (a local folder, or the hub cache: never the network).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from agentkv.server.config import ServeConfig
from agentkv.server.kv_modes import kv_mode

log = logging.getLogger("agentkv")

# model types whose layers are not all attention (vLLM's hybrid models), by their config's model_type
HYBRID_MODEL_TYPES = frozenset({
    "jamba", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba", "zamba2", "mamba", "mamba2",
    "plamo2", "lfm2", "lfm2_moe", "qwen3_next", "minimax", "minimax_m1", "falcon_mamba", "kimi_linear",
})


def model_config(model: str) -> dict | None:
    """The model's ``config.json`` as a dict: from its folder, or from the hub cache for a hub id
    (None: not found there, a GGUF file, unreadable)."""
    path = Path(model)
    try:
        if path.is_dir():
            file = path / "config.json"
        elif path.exists():
            return None                          # a single file (GGUF): no config.json to read
        else:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
            if not isinstance(found, str):
                return None
            file = Path(found)
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def hybrid_reason(config: dict) -> str | None:
    """Why a model with this ``config.json`` needs the hybrid KV cache manager (None: it does not)."""
    for c in (config, config.get("text_config")):
        if not isinstance(c, dict):
            continue
        kind = c.get("model_type")
        if kind in HYBRID_MODEL_TYPES:
            return f"{kind} mixes attention with state-space or linear-attention layers"
        kinds = c.get("layer_types")
        if isinstance(kinds, list) and any(k != "full_attention" for k in kinds):
            other = sorted({str(k) for k in kinds if k != "full_attention"})
            return f"its layers are not all full attention ({', '.join(other)})"
        if c.get("layers_block_type") or c.get("hybrid_override_pattern"):
            return "its layers are not all attention"
        window = c.get("sliding_window")
        if isinstance(window, int) and window > 0 and c.get("use_sliding_window", True) is not False:
            return f"it has sliding-window attention ({window} tokens)"
    return None


def without_retention(cfg: ServeConfig, model_path: str, device: str) -> ServeConfig:
    """``cfg``, with retention off where it alone would load the connector on a model that needs
    vLLM's hybrid KV cache manager (on a GPU); a warning says so."""
    if device == "cpu" or not cfg.kv_retention or kv_mode(cfg.kv_reuse).uses_connector:
        return cfg
    config = model_config(model_path)
    why = hybrid_reason(config) if config else None
    if why is None:
        return cfg
    log.warning("agentkv: KV retention is off for %s: %s, which needs vLLM's hybrid KV cache manager, and vLLM "
                "turns that off for any KV connector (docs/kv-reuse.md, 'Retention')", model_path, why)
    return cfg.model_copy(update={"kv_retention": False})
