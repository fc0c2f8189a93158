"""The host tier's bookkeeping (scheduler side): host blocks given to entries the pool took back,
the copies queued for the step, the bound (dropped in retention order: the longest paused session
first, never an entry a planned load reads), and the counts reported as metrics. The copies themselves and restoring
through the real engine: test_inprocess.py and tests/server/kv/test_reuse_engine.py."""

from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool

from agentkv.kernels.connector.held_blocks import PRIME, PROMPT, HeldBlocks, HeldEntry
from agentkv.kernels.connector.host_tier import HostTier

BS = 4


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=33, enable_caching=True, hash_block_size=BS)   # 32 + the null block


def entry(pool: BlockPool, session: str, blocks: int, kind: str = PROMPT, held_at: float = 0.0) -> HeldEntry:
    return HeldEntry(session, kind, list(range(blocks * BS)), pool.get_new_blocks(blocks), held_at=held_at)


def test_a_spill_gets_host_blocks_and_queues_one_copy_per_block(pool):
    tier = HostTier(8)
    e = entry(pool, "a", 3)
    assert tier.spill(e) and tier.get("a", PROMPT) is e and tier.used == 3
    assert tier.take_spills() == list(zip(e.block_ids, e.host_blocks)) and tier.take_spills() == []
    assert len(set(e.host_blocks)) == 3 and all(0 <= b < 8 for b in e.host_blocks)
    assert tier.take_counts() == {"spilled_blocks": 3, "restored_blocks": 0, "dropped_blocks": 0, "restores": 0}
    assert tier.take_counts()["spilled_blocks"] == 0                     # counts are since the last report


def test_full_the_oldest_pause_goes_first_but_never_one_a_load_reads(pool):
    tier = HostTier(8)
    a, b, c = entry(pool, "a", 3), entry(pool, "b", 3), entry(pool, "c", 4)
    tier.spill(a)
    tier.spill(b)
    assert tier.spill(c, protect=frozenset({id(a)}))                       # b goes, a is read by a planned load
    assert tier.get("a", PROMPT) is a and tier.get("b", PROMPT) is None and b.host_blocks is None
    assert set(a.host_blocks).isdisjoint(c.host_blocks) and tier.used == 7
    assert not tier.spill(entry(pool, "d", 2), protect=frozenset({id(a), id(c)}))   # nothing it may drop
    assert tier.get("d", PROMPT) is None and tier.used == 7
    assert tier.take_counts() == {"spilled_blocks": 10, "restored_blocks": 0, "dropped_blocks": 3 + 2, "restores": 0}


def test_the_session_paused_longest_goes_first_whatever_the_order_of_spills(pool):
    """Retention order: an entry spilled late (it stayed pinned in the pool within the budget) but
    held early belongs to the session whose pause began first: it goes before one held later."""
    tier = HostTier(8)
    recent = entry(pool, "recent", 3, held_at=20.0)
    old = entry(pool, "old", 3, held_at=5.0)
    tier.spill(recent)
    tier.spill(old)                                                        # spilled after the recent one
    assert tier.spill(entry(pool, "new", 4, held_at=30.0))
    assert tier.get("old", PROMPT) is None and tier.get("recent", PROMPT) is recent
    # held at the same moment: the larger goes (one session loses its K/V, not two)
    tier = HostTier(8)
    small, large = entry(pool, "small", 2, held_at=1.0), entry(pool, "large", 4, held_at=1.0)
    tier.spill(small)
    tier.spill(large)
    assert tier.spill(entry(pool, "next", 3, held_at=2.0))
    assert tier.get("large", PROMPT) is None and tier.get("small", PROMPT) is small


def test_an_entry_larger_than_the_tier_is_dropped_and_the_others_stay(pool):
    tier = HostTier(4)
    small = entry(pool, "s", 2)
    tier.spill(small)
    assert not tier.spill(entry(pool, "big", 5))
    assert tier.get("s", PROMPT) is small and tier.get("big", PROMPT) is None


def test_read_or_superseded_entries_give_their_blocks_back(pool):
    tier = HostTier(8)
    tier.spill(entry(pool, "a", 2))
    tier.spill(entry(pool, "a", 1, PRIME))
    first = entry(pool, "b", 3)
    tier.spill(first)
    second = entry(pool, "b", 2)                                           # b's newer prompt replaces it
    tier.spill(second)
    assert tier.get("b", PROMPT) is second and first.host_blocks is None and tier.used == 5
    tier.drop("a")                                                         # both kinds
    assert tier.get("a", PROMPT) is None and tier.get("a", PRIME) is None and tier.used == 2
    tier.clear()
    assert tier.used == 0 and not tier.entries and tier.take_spills() == []
    assert tier.take_counts()["dropped_blocks"] == 0                       # nothing was lost for room


def test_held_entries_reach_the_tier_when_the_pool_hands_their_blocks_out(pool):
    tier = HostTier(16)
    held = HeldBlocks(pool, BS, budget=4, ttl_s=60, on_lost=tier.spill)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    held.hold("a", PROMPT, list(range(12)), ids)
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    held.release_all("pressure")
    assert tier.get("a", PROMPT) is None                                   # released: still in the pool
    pool.get_new_blocks(pool.get_num_free_blocks())
    e = tier.get("a", PROMPT)
    assert e is not None and not e.valid and [d for d, _ in tier.take_spills()] == ids


def test_a_dropped_entrys_queued_copies_go_with_it(pool):
    """An entry spilled and then dropped for room in the same step: its copies are not run (its host
    blocks went to the newer entry, whose copies are)."""
    tier = HostTier(4)
    old, new = entry(pool, "a", 3), entry(pool, "b", 3)
    tier.spill(old)
    tier.spill(new)
    spills = tier.take_spills()
    assert [d for d, _ in spills] == new.block_ids and [h for _, h in spills] == new.host_blocks


def test_a_prefix_cache_reset_spills_nothing_and_empties_the_tier(pool):
    tier = HostTier(16)
    stale = entry(pool, "old", 2)
    tier.spill(stale)
    tier.take_spills()
    held = HeldBlocks(pool, BS, budget=4, ttl_s=60, on_lost=tier.spill, on_reset=tier.clear)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    held.hold("a", PROMPT, list(range(12)), ids)
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    held.release_all("pressure")
    pool.free_blocks(reversed(stale.blocks))                   # every block free: vLLM may reset now
    assert pool.reset_prefix_cache()
    assert held.get("a", PROMPT) is None and tier.get("a", PROMPT) is None and tier.get("old", PROMPT) is None
    assert tier.take_spills() == [] and tier.used == 0
