"""KVCacheManager: block accounting, reference counts, the prefix cache, eviction, step allocation."""

from __future__ import annotations

import random

import pytest

from cadenza.actors.cache_manager import KVCacheManager
from cadenza.actors.messages import BlockGrant, BlockNeed, Candidate
from cadenza.policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy

POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy}

_made: list[KVCacheManager] = []


def make_manager(num_blocks: int = 8, block_size: int = 16, policy: str = "lru", **kwargs) -> KVCacheManager:
    manager = KVCacheManager(num_blocks, block_size, POLICIES[policy](), **kwargs)
    _made.append(manager)
    return manager


def check(manager: KVCacheManager) -> None:
    """The manager's own invariants, and free + evictable + referenced == total."""
    manager.check_invariants()
    referenced = {b for b in range(manager.num_blocks) if manager._ref[b] > 0}
    assert manager.num_free + len(manager.policy) + len(referenced) == manager.num_blocks
    assert manager.num_available + manager.num_used == manager.num_blocks
    assert manager.num_used == len(referenced)


@pytest.fixture(autouse=True)
def _check_every_manager():
    _made.clear()
    yield
    for manager in _made:
        check(manager)
    _made.clear()


def prompt(*parts: int, block_size: int = 16, length: int | None = None) -> tuple[int, ...]:
    """Tokens made of full blocks, one block per part (all tokens of a block equal its part), then a tail."""
    tokens = tuple(t for part in parts for t in [part] * block_size)
    return tokens if length is None else tokens[:length]


def tokens_of(seed: int, n: int) -> tuple[int, ...]:
    return tuple(seed * 1000 + i for i in range(n))


def admit(manager: KVCacheManager, request_id: str, tokens: tuple[int, ...], num_new: int | None = None) -> BlockGrant:
    grant = manager.admit(request_id, tokens, len(tokens) if num_new is None else num_new)
    assert grant is not None, f"{request_id} did not fit"
    return grant


def run(manager: KVCacheManager, request_id: str, tokens: tuple[int, ...]) -> BlockGrant:
    """Admit a whole prompt and compute it, as one prefill step would."""
    grant = admit(manager, request_id, tokens)
    manager.commit(request_id, tokens[grant.num_cached_tokens :])
    return grant


def run_and_free(manager: KVCacheManager, request_id: str, tokens: tuple[int, ...]) -> BlockGrant:
    grant = run(manager, request_id, tokens)
    manager.free(request_id)
    return grant


# --- allocation ------------------------------------------------------------------------------------


def test_admit_grow_and_free():
    manager = make_manager(num_blocks=8, block_size=16)
    grant = admit(manager, "a", tokens_of(1, 20))
    assert grant.num_cached_tokens == 0
    assert len(grant.block_table) == 2 and manager.num_available == 6
    allocation = manager.allocate_step((BlockNeed("a", 40),), (), step_id=3)
    assert allocation.step_id == 3 and allocation.preempted == () and allocation.admitted == ()
    assert allocation.kept == (BlockGrant("a", manager.block_table("a")),)
    assert manager.block_table("a")[:2] == grant.block_table and len(manager.block_table("a")) == 3
    assert manager.num_available == 5
    # Growing within the blocks already held takes nothing.
    manager.allocate_step((BlockNeed("a", 48),), ())
    assert len(manager.block_table("a")) == 3
    check(manager)
    manager.free("a")
    assert manager.num_available == manager.num_free == 8 and manager.block_table("a") == ()
    manager.free("a")  # freeing twice is harmless
    assert manager.num_free == 8


def test_slot_usage_counts_the_unfilled_tail_of_each_table():
    manager = make_manager(num_blocks=8, block_size=16)
    assert manager.slot_usage() == (0, 0)
    admit(manager, "a", tokens_of(1, 20))  # 2 blocks for 20 tokens
    admit(manager, "b", tokens_of(2, 100), num_new=32)  # a first chunk of 32: exactly 2 blocks
    assert manager.slot_usage() == (64, 52)
    manager.allocate_step((BlockNeed("a", 33),), ())  # a third block for one token
    assert manager.slot_usage() == (80, 65)
    manager.free("a")
    assert manager.slot_usage() == (32, 32)


def test_admit_covers_only_the_tokens_asked_for():
    manager = make_manager(num_blocks=8, block_size=16)
    grant = admit(manager, "a", tokens_of(1, 100), num_new=32)
    assert len(grant.block_table) == 2


def test_admit_refuses_when_it_does_not_fit_and_changes_nothing():
    manager = make_manager(num_blocks=4, block_size=16)
    admit(manager, "a", tokens_of(1, 40))
    assert manager.admit("b", tokens_of(2, 40), 40) is None
    assert manager.block_table("b") == () and manager.num_available == 1
    with pytest.raises(ValueError):
        manager.admit("a", tokens_of(1, 40), 40)


def test_a_preempted_request_s_blocks_go_to_the_requests_kept():
    manager = make_manager(num_blocks=4, block_size=16)
    admit(manager, "x", tokens_of(1, 16))
    admit(manager, "a", tokens_of(2, 48))
    allocation = manager.allocate_step(
        (BlockNeed("x", 32), BlockNeed("a", 48)), (Candidate("b", tokens_of(3, 16), 16),)
    )
    assert [g.request_id for g in allocation.kept] == ["x"] and allocation.preempted == ("a",)
    assert allocation.admitted == ()  # admitting while preempting would only preempt again
    assert manager.block_table("a") == () and len(manager.block_table("x")) == 2
    assert manager.block_table("b") == () and manager.num_available == 2


# --- reference counts and prefix hits ----------------------------------------------------------------


def test_shared_prefix_blocks_are_reference_counted():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    first = run(manager, "a", tokens)
    second = admit(manager, "b", tokens)
    assert second.num_cached_tokens == 32
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [manager._ref[b] for b in first.block_table] == [2, 2, 1]
    assert manager.num_available == 8 - 4
    manager.free("a")
    # The shared blocks stay referenced by b; a's tail block goes back to the free list.
    assert [manager._ref[b] for b in second.block_table] == [1, 1, 1]
    assert manager.num_available == 8 - 3
    assert first.block_table[2] in manager._free
    check(manager)
    manager.free("b")
    assert manager.num_available == 8


def test_prefix_hit_reuses_full_blocks_and_counts_the_hit_rate():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    assert run_and_free(manager, "a", tokens).num_cached_tokens == 0
    assert manager.prefix_hit_rate == 0.0
    grant = admit(manager, "b", tokens)
    assert grant.num_cached_tokens == 32
    assert manager.prefix_hit_rate == pytest.approx(32 / 80)
    assert manager.prefix_hits == 32 and manager.prefix_queries == 80


def test_prompt_of_whole_blocks_reuses_all_but_its_last_block():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 48)
    first = run_and_free(manager, "a", tokens)
    assert manager.num_cached_blocks == 3
    grant = admit(manager, "b", tokens)
    # At least one token is computed, and the cached last block is not written into.
    assert grant.num_cached_tokens == 32
    assert grant.block_table[:2] == first.block_table[:2]
    assert grant.block_table[2] != first.block_table[2]
    manager.commit("b", tokens[32:])
    assert manager.num_cached_blocks == 3  # the recomputed copy does not displace the cached one


def test_one_block_prompt_gets_no_hit():
    manager = make_manager(num_blocks=4, block_size=16)
    tokens = tokens_of(1, 16)
    run_and_free(manager, "a", tokens)
    assert admit(manager, "b", tokens).num_cached_tokens == 0


def test_different_prompt_gets_no_hit():
    manager = make_manager(num_blocks=8, block_size=16)
    run_and_free(manager, "a", tokens_of(1, 40))
    assert admit(manager, "b", tokens_of(2, 40)).num_cached_tokens == 0
    assert manager.prefix_hits == 0


def test_prefix_hits_follow_the_chain_of_blocks():
    manager = make_manager(num_blocks=16, block_size=4)
    run_and_free(manager, "a", prompt(1, 2, 3, block_size=4) + (9,))
    # Same first block only: one block of hit.
    assert admit(manager, "b", prompt(1, 7, 3, block_size=4) + (9,)).num_cached_tokens == 4
    # Second and third blocks equal a's, first differs: their hashes chain from a different parent.
    assert admit(manager, "c", prompt(5, 2, 3, block_size=4) + (9,)).num_cached_tokens == 0
    # All three blocks: a full hit.
    assert admit(manager, "d", prompt(1, 2, 3, block_size=4) + (8,)).num_cached_tokens == 12


def test_commit_caches_only_full_blocks():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    admit(manager, "a", tokens)
    manager.commit("a", tokens[:10])
    assert manager.num_cached_blocks == 0
    manager.commit("a", tokens[10:20])
    assert manager.num_cached_blocks == 1
    manager.commit("a", tokens[20:40])
    assert manager.num_cached_blocks == 2  # the third block holds 8 of 16 tokens
    tail = manager.block_table("a")[2]
    manager.free("a")
    assert tail in manager._free and tail not in manager._hash_of
    assert len(manager.policy) == 2
    # Only the full blocks hit, and uncommitted tokens never do.
    assert admit(manager, "b", tokens).num_cached_tokens == 32


def test_uncommitted_blocks_are_not_cached():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    admit(manager, "a", tokens)
    manager.free("a")
    assert manager.num_cached_blocks == 0 and manager.num_free == 8
    assert admit(manager, "b", tokens).num_cached_tokens == 0


def test_commit_after_free_is_ignored():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    admit(manager, "a", tokens)
    manager.free("a")
    manager.commit("a", tokens)
    assert manager.num_cached_blocks == 0


def test_freed_request_leaves_its_full_blocks_cached_and_evictable():
    manager = make_manager(num_blocks=8, block_size=16)
    tokens = tokens_of(1, 40)
    first = run(manager, "a", tokens)
    manager.free("a")
    assert manager.num_available == 8  # cached blocks still count as available
    assert manager.num_cached_blocks == 2 and len(manager.policy) == 2 and manager.num_free == 6
    again = run(manager, "b", tokens)
    assert again.num_cached_tokens == 32 and again.block_table[:2] == first.block_table[:2]
    assert len(manager.policy) == 0


def test_cached_blocks_are_evicted_when_the_pool_runs_short():
    manager = make_manager(num_blocks=4, block_size=16)
    run_and_free(manager, "a", tokens_of(1, 40))
    assert manager.num_cached_blocks == 2
    admit(manager, "b", tokens_of(2, 64))  # every block, two of them evicted
    assert manager.num_cached_blocks == 0 and manager.num_available == 0
    manager.free("b")
    assert admit(manager, "c", tokens_of(1, 40)).num_cached_tokens == 0


def test_hits_on_evictable_blocks_count_against_the_room():
    manager = make_manager(num_blocks=4, block_size=16)
    tokens = tokens_of(1, 48)
    run_and_free(manager, "a", tokens)  # three cached blocks, one free
    admit(manager, "x", tokens_of(2, 16))  # takes the free block
    # b reuses two evictable blocks and needs a third: all three available, so a's last cached
    # block is evicted to make room.
    assert manager.admit("b", tokens, 48) is not None
    assert manager.num_available == 0 and manager.num_cached_blocks == 2
    manager.free("b")
    manager.free("x")
    admit(manager, "y", tokens_of(3, 32))  # free blocks go first, so the cached prefix survives
    assert manager.num_cached_blocks == 2


def test_hit_refused_when_evictable_hits_leave_no_room():
    manager = make_manager(num_blocks=4, block_size=16)
    tokens = tokens_of(1, 48)
    run_and_free(manager, "a", tokens)
    admit(manager, "x", tokens_of(2, 32))  # the free block and one evicted
    # Two cached blocks hit but both are evictable: with the third block b needs 3 > 2.
    assert manager.admit("b", tokens, 48) is None
    assert manager.num_cached_blocks == 2 and manager.num_available == 2


@pytest.mark.parametrize(("policy", "victim"), [("lru", "B"), ("lfu", "C"), ("fifo", "A")])
def test_eviction_order_follows_the_policy(policy, victim):
    manager = make_manager(num_blocks=4, block_size=4, policy=policy)
    prompts = {name: prompt(i + 1, block_size=4) + (0,) for i, name in enumerate("ABC")}
    for name in "ABC":  # each leaves one cached block behind: cached and released in order A, B, C
        run_and_free(manager, name, prompts[name])
    # Reuses: B twice (most uses, but long ago), then C, then A (most recent).
    # lru evicts B (released longest ago), lfu C (2 uses, released before A's), fifo A (cached first).
    for i, name in enumerate("BBCA"):
        assert run_and_free(manager, f"{name}{i}", prompts[name]).num_cached_tokens == 4
    assert manager.num_free == 1 and len(manager.policy) == 3
    admit(manager, "D", tokens_of(9, 8))  # the free block and one victim
    manager.free("D")
    survivors = {name for name in "ABC" if run_and_free(manager, f"probe{name}", prompts[name]).num_cached_tokens}
    assert survivors == set("ABC") - {victim}


def test_lru_evicts_tail_blocks_of_a_prefix_first():
    manager = make_manager(num_blocks=4, block_size=4)
    tokens = prompt(1, 2, 3, block_size=4) + (0,)
    run_and_free(manager, "a", tokens)
    admit(manager, "b", tokens_of(9, 8))  # the free block and the last cached block of a
    manager.free("b")
    assert admit(manager, "c", tokens, num_new=1).num_cached_tokens == 8


# --- the step: the longest prefix of the running that fits, then new ones in order --------------------


def test_running_requests_keep_the_longest_prefix_that_fits():
    manager = make_manager(num_blocks=6, block_size=4)
    admit(manager, "a", tokens_of(1, 4))
    admit(manager, "b", tokens_of(2, 4))
    a_blocks = manager.block_table("a")
    # a alone fits (2 of the 4 available blocks); with b (3 more) they do not: b, ranked below,
    # is released, and c is not admitted in a step that preempts.
    allocation = manager.allocate_step(
        (BlockNeed("a", 12), BlockNeed("b", 16)), (Candidate("c", tokens_of(3, 4), 4),)
    )
    assert allocation.kept == (BlockGrant("a", manager.block_table("a")),)
    assert allocation.preempted == ("b",) and allocation.admitted == ()
    assert manager.block_table("a")[:1] == a_blocks and len(manager.block_table("a")) == 3
    assert manager.block_table("b") == manager.block_table("c") == ()
    assert manager.num_available == 3
    # Within the room, every running request grows and nothing is preempted.
    allocation = manager.allocate_step((BlockNeed("a", 16),), ())
    assert [len(g.block_table) for g in allocation.kept] == [4] and allocation.preempted == ()


def test_the_top_request_is_preempted_when_it_does_not_fit_even_alone():
    manager = make_manager(num_blocks=4, block_size=4)
    admit(manager, "a", tokens_of(1, 8))
    admit(manager, "b", tokens_of(2, 4))
    allocation = manager.allocate_step((BlockNeed("a", 20), BlockNeed("b", 5)), ())
    assert allocation.kept == () and allocation.preempted == ("a", "b")
    assert manager.num_available == 4


def test_releasing_a_shared_prefix_frees_only_blocks_no_kept_request_holds():
    # a and b share two cached blocks; x and a and b each need one more block, and none is free.
    # Releasing b frees its own block only (a holds the shared ones): one block, x and a need two.
    # Releasing a as well frees the shared blocks and a's own: x is kept alone.
    manager = make_manager(num_blocks=5, block_size=4)
    shared = tokens_of(1, 8)
    admit(manager, "x", tokens_of(2, 4))
    run(manager, "a", shared + (5, 5))
    admit(manager, "b", shared + (7, 7))
    assert manager.block_table("a")[:2] == manager.block_table("b")[:2] and manager.num_available == 0
    needs = (BlockNeed("x", 5), BlockNeed("a", 13), BlockNeed("b", 13))
    allocation = manager.allocate_step(needs, ())
    assert [g.request_id for g in allocation.kept] == ["x"] and allocation.preempted == ("a", "b")
    # The shared blocks are cached: released, they stay available for a later hit.
    assert len(manager.block_table("x")) == 2
    assert manager.num_available == 3 and manager.num_cached_blocks == 2


def test_new_requests_are_refused_in_order_once_one_does_not_fit():
    manager = make_manager(num_blocks=6, block_size=4)
    admit(manager, "a", tokens_of(1, 4))
    waiting = (
        Candidate("b", tokens_of(2, 8), 8),  # 2 blocks: fits (4 left after a)
        Candidate("c", tokens_of(3, 12), 12),  # 3 blocks: only 2 left
        Candidate("d", tokens_of(4, 4), 4),  # would fit, refused to keep the order
    )
    allocation = manager.allocate_step((BlockNeed("a", 8),), waiting)
    assert [g.request_id for g in allocation.kept] == ["a"]
    assert [g.request_id for g in allocation.admitted] == ["b"]
    assert manager.num_available == 2 and manager.block_table("c") == manager.block_table("d") == ()


def test_a_refused_candidate_changes_nothing():
    manager = make_manager(num_blocks=2, block_size=4)
    allocation = manager.allocate_step((), (Candidate("a", tokens_of(1, 12), 12),))
    assert allocation.admitted == () and manager.num_available == 2 and manager.prefix_queries == 0


def test_step_grant_carries_the_cached_prefix():
    manager = make_manager(num_blocks=8, block_size=4)
    tokens = tokens_of(1, 10)
    run_and_free(manager, "a", tokens)
    allocation = manager.allocate_step((), (Candidate("b", tokens, 4),))
    # 8 tokens cached, then 4 more asked for but only 2 remain in the prompt.
    [grant] = allocation.admitted
    assert grant.num_cached_tokens == 8 and len(grant.block_table) == 3


def test_prefix_caching_disabled_never_hits():
    manager = make_manager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    tokens = tokens_of(1, 40)
    run_and_free(manager, "a", tokens)
    assert manager.num_cached_blocks == 0 and manager.num_free == 8
    assert run(manager, "b", tokens).num_cached_tokens == 0
    assert manager.prefix_hit_rate == 0.0


# --- randomized -------------------------------------------------------------------------------------


class FakeKV:
    """What each block slot holds, to check that hits read what was written and shared blocks are not written."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.slots: dict[int, dict[int, int]] = {}

    def write(self, request_id: str, start: int, tokens) -> None:
        size, table = self.manager.block_size, self.manager.block_table(request_id)
        for position, token in enumerate(tokens, start):
            block = table[position // size]
            assert self.manager._ref[block] == 1, f"{request_id} writes into shared block {block}"
            self.slots.setdefault(block, {})[position % size] = token

    def check_prefix(self, request_id: str, tokens, num_cached: int) -> None:
        size, table = self.manager.block_size, self.manager.block_table(request_id)
        for position in range(num_cached):
            assert self.slots[table[position // size]][position % size] == tokens[position]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_operations_keep_the_invariants(policy):
    rng = random.Random(1234)
    block_size = 4
    manager = make_manager(num_blocks=24, block_size=block_size, policy=policy)
    kv = FakeKV(manager)
    prefixes = [tuple(rng.randrange(50) for _ in range(rng.randrange(0, 13))) for _ in range(4)]
    live: dict[str, list] = {}  # request id -> [all tokens, tokens committed, tokens covered]
    ids = iter(range(10**6))
    hits = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not live:
            tokens = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randrange(1, 10)))
            rid = f"r{next(ids)}"
            num_new = rng.randrange(1, len(tokens) + 1)
            grant = manager.admit(rid, tokens, num_new)
            if grant is not None:
                cached = grant.num_cached_tokens
                assert cached % block_size == 0 and cached < len(tokens)
                assert len(grant.block_table) * block_size >= min(len(tokens), cached + num_new)
                kv.check_prefix(rid, tokens, cached)
                hits += cached > 0
                live[rid] = [list(tokens), cached, min(len(tokens), cached + num_new)]
        elif op < 0.6:
            rid = rng.choice(sorted(live))
            tokens, committed, covered = live[rid]
            if committed < covered:
                n = rng.randrange(1, covered - committed + 1)
                kv.write(rid, committed, tokens[committed : committed + n])
                manager.commit(rid, tuple(tokens[committed : committed + n]))
                live[rid][1] = committed + n
            else:  # everything covered is computed: decode one more token
                tokens.append(rng.randrange(3))
                allocation = manager.allocate_step((BlockNeed(rid, len(tokens)),), ())
                if allocation.kept:
                    live[rid][2] = len(tokens)
                else:  # it does not fit even alone: preempted, its blocks released
                    assert allocation.preempted == (rid,) and manager.block_table(rid) == ()
                    del live[rid]
        else:
            rid = rng.choice(sorted(live))
            manager.free(rid)
            del live[rid]
        check(manager)
        for rid, (tokens, committed, covered) in live.items():
            assert len(manager.block_table(rid)) * block_size >= covered
    for rid in list(live):
        manager.free(rid)
    check(manager)
    assert manager.num_available == manager.num_blocks
    assert hits > 50


def test_a_cache_salt_shares_prefixes_only_with_the_same_salt():
    """vLLM's cache_salt enters the hash chain: tenants with different salts (or none) never hit
    each other's blocks, so a hit's timing reveals nothing of another tenant's prompt."""
    from cadenza.actors.cache_manager import prompt_hashes, salt_root

    manager = make_manager(num_blocks=16, block_size=4)
    prompt = tokens_of(1, 13)
    assert manager.admit("a", prompt, len(prompt), salt="tenant-a").num_cached_tokens == 0
    manager.commit("a", prompt)
    manager.free("a")
    for salt, cached in (("tenant-b", 0), (None, 0), ("tenant-a", 12)):
        grant = manager.admit(f"r-{salt}", prompt, len(prompt), salt=salt)
        assert grant.num_cached_tokens == cached, salt
        manager.commit(f"r-{salt}", prompt)
        manager.free(f"r-{salt}")
    check(manager)
    # The hashes others compute (the router, the KV tiers, a prefill replica) chain the same way.
    assert prompt_hashes(prompt, 4, "tenant-a") != prompt_hashes(prompt, 4, "tenant-b") != prompt_hashes(prompt, 4)
    assert manager.hold_cached("h", prompt_hashes(prompt, 4, "tenant-a")) and salt_root(None) is None
