"""Blend's planning (no engine): the splice of the new prompt, how each strategy ranks the moved
blocks, and the passes a plan needs. The engine side is in test_reuse_engine.py."""

from dataclasses import dataclass

import numpy as np
import pytest
from pydantic import ValidationError

from agentkv.server.kv.blend import budget_blocks, candidates, holes, movable_end, plan, rank, splice
from agentkv.server.options import KVBlend


@dataclass
class Edit:
    start: int
    end: int
    replacement_ids: tuple[int, ...]


OLD = list(range(1000, 1200))                      # 200 old tokens
EDITS = [Edit(40, 80, (1, 2)), Edit(100, 140, (3, 4, 5))]


def test_splice_maps_every_new_token_to_its_source():
    sp = splice(OLD, EDITS)
    assert sp.ids == OLD[:40] + [1, 2] + OLD[80:100] + [3, 4, 5] + OLD[140:]
    assert len(sp.ids) == 200 - 80 + 5 and sp.first == 40 and sp.cuts == [40, 62]
    for q, t in enumerate(sp.ids):
        if sp.old_pos[q] >= 0:
            assert OLD[sp.old_pos[q]] == t and sp.prime_pos[q] == -1
        else:   # the priming prompt is the prefix, then every replacement back to back
            prime = OLD[:40] + [1, 2, 3, 4, 5]
            assert prime[sp.prime_pos[q]] == t


def test_only_held_tokens_are_movable():
    sp = splice(OLD, EDITS)                        # old 190.. -> new 115..; the last 10 old tokens unheld
    assert movable_end(sp, 200) == 125 and movable_end(sp, 190) == 115
    assert candidates(sp, 8, movable_end(sp, 190)) == range(5, 14)
    assert movable_end(sp, 0) == 65                # nothing of the old prompt held: the replacements are


def test_each_strategy_ranks_the_moved_blocks():
    sp = splice(OLD, EDITS)                        # 125 tokens; blocks of 8: candidates 5..14
    blocks = candidates(sp, 8, 125)
    assert blocks == range(5, 15)
    assert rank("tail", sp, blocks, 8)[:3] == [14, 13, 12]
    assert rank("cuts", sp, blocks, 8)[:4] == [5, 7, 6, 8]  # round robin over the cuts' blocks (40 -> 5, 62 -> 7)
    dev = np.zeros(len(sp.ids))
    dev[90] = 5.0
    dev[70] = 3.0
    assert rank("deviation", sp, blocks, 8, dev)[:2] == [11, 8]
    with pytest.raises(ValueError, match="deviation"):
        rank("deviation", sp, blocks, 8)


def test_plans_recompute_the_fraction_in_whole_blocks():
    sp = splice(OLD, EDITS)
    assert budget_blocks(0.0, range(5, 15)) == 0 and budget_blocks(0.01, range(5, 15)) == 1
    assert budget_blocks(0.3, range(5, 15)) == 3
    tail = plan("tail", 0.3, sp, 8, 200)           # one request: its own limit, no pass
    assert tail.passes == [] and tail.limit == 12 * 8 and tail.recompute_tokens == 24 and tail.movable_tokens == 80
    cuts = plan("cuts", 0.3, sp, 8, 200)           # blocks 5, 7, 6 -> one range in the middle: one pass
    assert cuts.passes == [(40, 64)] and cuts.limit is None
    assert holes([3, 4, 9], 8) == [(24, 40), (72, 80)]
    assert plan("tail", 0.0, sp, 8, 200) == plan("cuts", 0.0, sp, 8, 200)   # fraction 0 is shift


def test_request_field_is_validated():
    assert KVBlend(strategy="cuts", fraction=0.05).fraction == 0.05
    for bad in ({"strategy": "middle"}, {"fraction": 1.5}, {"fraction": -0.1}, {"ratio": 0.1}):
        with pytest.raises(ValidationError):
            KVBlend(**bad)


def test_probe_reads_layer_one_kv_as_the_whole_model_computes_it(tiny_model_dir):
    """The probe runs layer 0 only, then layer 1's norm and K/V projections: the same numbers as
    the whole model's layer 1 (hooked), and deviations are zero where nothing moves."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentkv.server.kv.probe import Probe

    probe = Probe(str(tiny_model_dir))
    ids = [(i * 37) % 2000 + 5 for i in range(300)]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).model
    seen = {}
    attn = model.layers[1].self_attn
    attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o))
    attn.v_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("v", o))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    np.testing.assert_allclose(probe.kv(ids), torch.cat([seen["k"][0], seen["v"][0]], -1).numpy(), atol=1e-5)

    old = ids[:200]
    edits = [Edit(40, 80, (7, 8))]
    sp = splice(old, edits)
    dev = probe.deviation(old, old[:40] + [7, 8], sp)
    assert dev.shape == (len(sp.ids),) and not dev[:40].any()
    assert dev[42:].max() > 0        # kept tokens after the cut lost context: their layer-1 K/V moved
    same = probe.deviation(old, old[:40], splice(old, [Edit(40, 40, ())]))   # an empty edit moves nothing
    assert np.allclose(same, 0, atol=1e-4)
