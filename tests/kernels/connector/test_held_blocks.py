"""The connector's held blocks on vLLM's real block pool: references taken and given back, the
budget, time-to-live and memory pressure, and entries that go when vLLM hands a block out."""

from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool

from agentkv.kernels.connector.held_blocks import PRIME, PROMPT, HeldBlocks

BS = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=21, enable_caching=True, hash_block_size=BS)   # 20 + the null block


def finished_request(pool: BlockPool, tokens: int) -> list[int]:
    """A request's blocks as vLLM allocated them; the caller frees them after ``hold``."""
    return [b.block_id for b in pool.get_new_blocks(-(-tokens // BS))]


def free(pool: BlockPool, ids: list[int]) -> None:
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))


def test_held_blocks_survive_their_request_and_go_back_when_dropped(pool):
    held = HeldBlocks(pool, BS, budget=10, ttl_s=60)
    ids = finished_request(pool, 10)
    assert held.hold("s", PROMPT, list(range(10)), ids) is None
    free(pool, ids)                                         # vLLM frees the finished request
    assert pool.get_num_free_blocks() == 20 - 3 and held.held_blocks == 3
    assert held.get("s", PROMPT).block_ids == ids
    held.drop("s")
    assert pool.get_num_free_blocks() == 20 and held.held_blocks == 0 and held.get("s", PROMPT) is None
    assert held.missing_reason("s") == "not_held"


def test_budget_releases_the_oldest_which_stays_readable_until_handed_out(pool):
    held = HeldBlocks(pool, BS, budget=4, ttl_s=60)
    a = finished_request(pool, 12)
    held.hold("a", PROMPT, list(range(12)), a)
    free(pool, a)
    b = finished_request(pool, 8)
    held.hold("b", PROMPT, list(range(8)), b)
    free(pool, b)
    assert held.held_blocks == 2 and not held.get("a", PROMPT).pinned and held.get("b", PROMPT).pinned
    assert pool.get_num_free_blocks() == 20 - 2                # a's blocks count as free again
    assert held.get("a", PROMPT) is not None                    # but still hold what they held
    pool.get_new_blocks(pool.get_num_free_blocks())             # vLLM hands every free block out
    assert held.get("a", PROMPT) is None and held.missing_reason("a") == "evicted"
    assert held.get("b", PROMPT) is not None


def test_too_big_for_the_budget_and_zero_budget(pool):
    assert HeldBlocks(pool, BS, budget=0, ttl_s=60).hold("z", PROMPT, [1], finished_request(pool, 1)) == "no_budget"
    lost = []
    held = HeldBlocks(pool, BS, budget=2, ttl_s=60, on_lost=lost.append)
    ids = finished_request(pool, 12)
    assert held.hold("s", PROMPT, list(range(12)), ids) is None        # released at once: readable, not pinned
    free(pool, ids)
    entry = held.get("s", PROMPT)
    assert entry is not None and not entry.pinned and held.held_blocks == 0
    pool.get_new_blocks(pool.get_num_free_blocks())                     # handed out: gone, and the hook hears it
    assert held.get("s", PROMPT) is None and held.missing_reason("s") == "evicted" and lost == [entry]


def test_ttl_pressure_and_pinning_again(pool):
    clock = Clock()
    held = HeldBlocks(pool, BS, budget=20, ttl_s=30, clock=clock)
    for s in ("a", "b", "c"):
        ids = finished_request(pool, 16)
        held.hold(s, PROMPT, list(range(16)), ids)
        free(pool, ids)
        clock.now += 10
    assert held.held_blocks == 12 and pool.get_num_free_blocks() == 8
    held.expire()                                               # a is 30 s old: released
    assert [e.session for e in held.entries.values() if e.pinned] == ["b", "c"]
    held.make_room(14, keep="b")                                # an admission needs 14: c goes first
    assert [e.session for e in held.entries.values() if e.pinned] == ["b"] and pool.get_num_free_blocks() == 16
    held.pin([held.get("a", PROMPT)])                           # about to be read: a reference again
    assert held.get("a", PROMPT).pinned and pool.get_num_free_blocks() == 12
    assert held.release_all("pressure") is True and held.release_all("pressure") is False
    assert pool.get_num_free_blocks() == 20 and held.held_blocks == 0


def test_prompt_and_prime_share_prefix_blocks(pool):
    held = HeldBlocks(pool, BS, budget=20, ttl_s=60)
    ids = finished_request(pool, 12)
    held.hold("s", PROMPT, list(range(12)), ids)
    free(pool, ids)
    prefix = [pool.blocks[i] for i in ids[:1]]
    pool.touch(prefix)                                          # the priming request's prefix hit
    prime = [ids[0]] + [b.block_id for b in pool.get_new_blocks(1)]
    held.hold("s", PRIME, list(range(8)), prime)
    free(pool, prime)
    assert held.held_blocks == 5 and pool.get_num_free_blocks() == 20 - 4
    held.drop("s")
    assert pool.get_num_free_blocks() == 20 and all(b.ref_cnt == 0 for b in pool.blocks[1:])
