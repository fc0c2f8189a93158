"""The deviation probe of ``blend``'s CacheBlend-like strategy: how far each moved token's K/V is
from what recomputing would give, measured at an early layer.

Layer 0's K/V depend only on the token and its position, so moving them is exact; from layer 1 on
they carry the context, which clearing changed. The probe runs the model's first decoder
layer (transformers, on the front's CPU, weights of layers 0 and 1 only) over the old prompt, the
priming prompt and the new prompt, and takes layer 1's keys and values before RoPE (a rotation keeps
norms, so pre-RoPE differences equal the rotated ones) and scores each new position by
``|K_new - K_src| + |V_new - V_src|`` against the position its K/V would be moved from.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache

import numpy as np

from .blend import Splice

log = logging.getLogger(__name__)
LAYER = 1
_lock = threading.Lock()   # one probe at a time: it uses every core the front has


class Probe:
    def __init__(self, model_path: str):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        t0 = time.perf_counter()
        config = AutoConfig.from_pretrained(model_path)
        self.layer = min(LAYER, config.num_hidden_layers - 1)   # a 1-layer model: layer 0 (nothing deviates)
        config.num_hidden_layers = self.layer + 1               # only these layers' weights are loaded
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:self.layer + 1]
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32).model
        model.eval()
        self.target = model.layers[self.layer]          # only its norm and K/V projections run
        model.layers = torch.nn.ModuleList(list(model.layers)[:self.layer])
        source = model.layers[-1] if self.layer else model.embed_tokens
        self._h: list = [None]
        source.register_forward_hook(lambda m, i, o: self._h.__setitem__(0, o[0] if isinstance(o, tuple) else o))
        self.model = model
        log.info("deviation probe: layers 0..%d of %s loaded in %.1f s", self.layer, model_path,
                 time.perf_counter() - t0)

    def kv(self, ids: list[int]) -> np.ndarray:
        """Layer ``self.layer``'s keys and values before RoPE, ``[len(ids), 2 * kv_width]``."""
        import torch

        if not ids:
            return np.zeros((0, 0), dtype=np.float32)
        with torch.inference_mode():
            self.model(input_ids=torch.tensor([ids]), use_cache=False)
            x = self.target.input_layernorm(self._h[0][0])
            attn = self.target.self_attn
            return torch.cat([attn.k_proj(x), attn.v_proj(x)], dim=-1).float().numpy()

    def deviation(self, old_ids: list[int], prime_ids: list[int], sp: Splice) -> np.ndarray:
        """Per new position: the distance between its recomputed and its moved layer-1 K/V
        (0 before the first cut, where nothing moves)."""
        with _lock:
            new = self.kv(sp.ids)
            old = self.kv(old_ids)
            prime = self.kv(prime_ids)
        src = np.zeros_like(new)
        from_old = sp.old_pos >= 0
        src[from_old] = old[sp.old_pos[from_old]]
        src[~from_old] = prime[sp.prime_pos[~from_old]]
        half = new.shape[1] // 2
        d = new - src
        out = np.linalg.norm(d[:, :half], axis=1) + np.linalg.norm(d[:, half:], axis=1)
        out[:sp.first] = 0.0
        return out


@lru_cache(maxsize=2)
def probe_for(model_path: str) -> Probe:
    """One probe per model, loaded on first use."""
    return Probe(model_path)
