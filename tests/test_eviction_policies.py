"""Built-in eviction policies: exact victim order per policy, and a randomized reference check."""

from __future__ import annotations

import random

import pytest

from cadenza.policies.eviction import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy

POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    return POLICIES[name]()


def cache(policy: EvictionPolicy, *block_ids: int) -> None:
    """Each block enters the prefix cache while its request holds it, then the request finishes."""
    for block_id in block_ids:
        policy.on_cached(block_id)
    for block_id in block_ids:
        policy.on_release(block_id)


def reuse(policy: EvictionPolicy, *block_ids: int) -> None:
    """A request hits each block as a cached prefix and then finishes with it."""
    for block_id in block_ids:
        policy.on_acquire(block_id)
        policy.on_release(block_id)


def drain(policy: EvictionPolicy) -> list[int]:
    """Every victim in eviction order; the policy is empty afterwards."""
    victims = []
    while len(policy):
        victims.append(policy.pop_victim())
    with pytest.raises(LookupError):
        policy.pop_victim()
    return victims


def test_policies_are_named_after_their_registry_name():
    assert {name: cls.name for name, cls in POLICIES.items()} == {name: name for name in POLICIES}


# --- order of victims --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lru", [0, 1, 2, 3]),
        ("lfu", [0, 1, 2, 3]),
        ("fifo", [0, 1, 2, 3]),
    ],
)
def test_untouched_blocks_go_in_release_order(name, expected):
    policy = make_policy(name)
    cache(policy, 0, 1, 2, 3)
    assert drain(policy) == expected


def test_lru_evicts_least_recently_released():
    policy = make_policy("lru")
    cache(policy, 0, 1, 2, 3)
    reuse(policy, 2, 0)
    assert drain(policy) == [1, 3, 2, 0]


def test_lru_orders_by_release_not_by_acquisition():
    policy = make_policy("lru")
    cache(policy, 0, 1, 2)
    policy.on_acquire(0)
    policy.on_acquire(1)
    policy.on_release(1)  # acquired after 0 but released first
    policy.on_release(0)
    assert drain(policy) == [2, 1, 0]


def test_fifo_evicts_by_first_cached_regardless_of_reuse():
    policy = make_policy("fifo")
    cache(policy, 0, 1, 2, 3)
    reuse(policy, 0, 0, 0, 1)
    assert drain(policy) == [0, 1, 2, 3]


def test_fifo_uses_the_time_cached_not_the_time_released():
    policy = make_policy("fifo")
    for block_id in (0, 1, 2):
        policy.on_cached(block_id)
    for block_id in (2, 1, 0):
        policy.on_release(block_id)
    assert drain(policy) == [0, 1, 2]


def test_lfu_evicts_fewest_acquisitions():
    policy = make_policy("lfu")
    cache(policy, 0, 1, 2, 3)
    reuse(policy, 2, 2, 0, 3, 3, 3)  # uses: 0 -> 2, 1 -> 1, 2 -> 3, 3 -> 4
    assert drain(policy) == [1, 0, 2, 3]


def test_lfu_ties_go_to_the_least_recently_released():
    policy = make_policy("lfu")
    cache(policy, 0, 1, 2)
    policy.on_acquire(0)
    policy.on_acquire(1)
    policy.on_release(1)
    policy.on_release(0)  # 0 and 1 both used twice; 1 was released first
    assert drain(policy) == [2, 1, 0]


def test_lfu_counts_concurrent_acquisitions():
    policy = make_policy("lfu")
    cache(policy, 0, 1)
    reuse(policy, 1, 1)  # 1 used three times, one request at a time
    for _ in range(3):
        policy.on_acquire(0)  # three requests share 0 at once ...
    policy.on_release(0)  # ... and it is released once, by the last of them: four uses
    assert drain(policy) == [1, 0]


def test_lfu_counts_restart_when_a_block_is_cached_again():
    policy = make_policy("lfu")
    cache(policy, 0, 1)
    reuse(policy, 0, 0, 0, 1)  # 0 used four times, 1 twice
    policy.on_evict(0)
    cache(policy, 0)  # a new block under the same id: used once
    assert drain(policy) == [0, 1]


def test_fifo_time_restarts_when_a_block_is_cached_again():
    policy = make_policy("fifo")
    cache(policy, 0, 1)
    assert policy.pop_victim() == 0
    cache(policy, 0)
    assert drain(policy) == [1, 0]


# --- what is evictable -------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_reacquired_blocks_are_not_evictable(name):
    policy = make_policy(name)
    cache(policy, 0, 1, 2)
    policy.on_acquire(0)
    policy.on_acquire(2)
    assert len(policy) == 1
    assert drain(policy) == [1]
    policy.on_release(2)
    assert len(policy) == 1
    assert drain(policy) == [2]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("lru", [1, 0]), ("lfu", [1, 0]), ("fifo", [0, 1])],
)
def test_stale_entry_is_skipped(name, expected):
    policy = make_policy(name)
    cache(policy, 0, 1)
    policy.on_acquire(0)
    policy.on_release(0)  # 0's first release is now stale
    assert len(policy) == 2
    assert drain(policy) == expected  # 0 comes out exactly once


@pytest.mark.parametrize("name", POLICIES)
def test_many_stale_entries_of_the_same_block(name):
    policy = make_policy(name)
    cache(policy, 0, 1)
    reuse(policy, *[0] * 10)
    policy.on_acquire(0)  # held now: every earlier entry for 0 is stale
    assert len(policy) == 1
    assert drain(policy) == [1]
    policy.on_release(0)
    assert drain(policy) == [0]


@pytest.mark.parametrize("name", POLICIES)
def test_pop_victim_on_empty_raises_lookup_error(name):
    policy = make_policy(name)
    with pytest.raises(LookupError):
        policy.pop_victim()
    policy.on_cached(0)  # cached but still held
    with pytest.raises(LookupError):
        policy.pop_victim()


@pytest.mark.parametrize("name", POLICIES)
def test_len_counts_only_evictable_blocks(name):
    policy = make_policy(name)
    assert len(policy) == 0
    for block_id in range(4):
        policy.on_cached(block_id)
    assert len(policy) == 0  # all still held by the requests that filled them
    policy.on_release(1)
    policy.on_release(3)
    assert len(policy) == 2
    policy.on_release(3)  # a repeated release does not count twice
    assert len(policy) == 2
    policy.on_acquire(1)
    assert len(policy) == 1
    policy.on_acquire(1)  # a second request on an already held block
    assert len(policy) == 1
    policy.pop_victim()
    assert len(policy) == 0


@pytest.mark.parametrize("name", POLICIES)
def test_on_evict_removes_the_block(name):
    policy = make_policy(name)
    cache(policy, 0, 1, 2)
    policy.on_evict(1)
    assert len(policy) == 2
    assert drain(policy) == [0, 2]


@pytest.mark.parametrize("name", POLICIES)
def test_on_evict_of_a_held_block(name):
    policy = make_policy(name)
    cache(policy, 0, 1)
    policy.on_acquire(0)
    policy.on_evict(0)
    assert len(policy) == 1
    assert drain(policy) == [1]


@pytest.mark.parametrize("name", POLICIES)
def test_hot_block_does_not_grow_the_policy(name):
    """A prefix hit leaves a stale entry behind; a long run of hits without evictions must not
    accumulate them (regression: the heap grew by one entry per hit until something was evicted)."""
    policy = make_policy(name)
    cache(policy, 0, 1, 2)
    reuse(policy, *[1] * 10_000)
    assert len(policy._heap) < 100
    expected = {"lru": [0, 2, 1], "lfu": [0, 2, 1], "fifo": [0, 1, 2]}[name]
    assert drain(policy) == expected


# --- randomized comparison with a reference model ----------------------------------------------


class Reference:
    """The obvious, slow version of each policy, on plain lists."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cached_order: list[int] = []  # cached blocks, first cached first
        self.evictable: list[int] = []  # evictable blocks, least recently released first
        self.uses: dict[int, int] = {}

    def on_cached(self, block_id: int) -> None:
        self.cached_order.append(block_id)
        self.uses[block_id] = 1

    def on_release(self, block_id: int) -> None:
        if block_id in self.evictable:
            self.evictable.remove(block_id)
        self.evictable.append(block_id)

    def on_acquire(self, block_id: int) -> None:
        if block_id in self.evictable:
            self.evictable.remove(block_id)
        self.uses[block_id] += 1

    def on_evict(self, block_id: int) -> None:
        if block_id in self.evictable:
            self.evictable.remove(block_id)
        self.cached_order.remove(block_id)
        del self.uses[block_id]

    def victim(self) -> int:
        if self.name == "lru":
            return self.evictable[0]
        if self.name == "fifo":
            return min(self.evictable, key=self.cached_order.index)
        return min(self.evictable, key=lambda block_id: self.uses[block_id])  # first minimum: ties

    def pop_victim(self) -> int:
        block_id = self.victim()
        self.on_evict(block_id)
        return block_id


def run_random_operations(name: str, seed: int, num_ops: int, evict_weight: float) -> None:
    rng = random.Random(seed)
    policy, reference = make_policy(name), Reference(name)
    refcounts: dict[int, int] = {}  # cached block -> requests holding it
    block_ids = range(24)
    kinds = ["cache", "acquire", "release", "pop", "evict"]
    weights = [0.2, 0.3, 0.35, evict_weight, 0.03]
    for step in range(num_ops):
        kind = rng.choices(kinds, weights)[0]
        uncached = [b for b in block_ids if b not in refcounts]
        held = [b for b, count in refcounts.items() if count]
        if kind == "cache" and uncached:
            block_id = rng.choice(uncached)
            refcounts[block_id] = 1
            policy.on_cached(block_id)
            reference.on_cached(block_id)
        elif kind == "acquire" and refcounts:
            block_id = rng.choice(sorted(refcounts))
            refcounts[block_id] += 1
            policy.on_acquire(block_id)
            reference.on_acquire(block_id)
        elif kind == "release" and held:
            block_id = rng.choice(held)
            refcounts[block_id] -= 1
            if refcounts[block_id] == 0:
                policy.on_release(block_id)
                reference.on_release(block_id)
        elif kind == "pop" and len(reference.evictable):
            victim = policy.pop_victim()
            assert victim == reference.pop_victim(), f"{name}, seed {seed}, step {step}"
            del refcounts[victim]
        elif kind == "evict" and refcounts:
            block_id = rng.choice(sorted(refcounts))
            policy.on_evict(block_id)
            reference.on_evict(block_id)
            del refcounts[block_id]
        assert len(policy) == len(reference.evictable), f"{name}, seed {seed}, step {step}"
    while reference.evictable:
        assert policy.pop_victim() == reference.pop_victim()
    assert len(policy) == 0
    with pytest.raises(LookupError):
        policy.pop_victim()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(
    ("seed", "evict_weight"),
    [
        (0, 0.15),  # evictions common
        (1, 0.15),
        (2, 0.005),  # evictions rare: stale entries pile up between them
    ],
)
def test_matches_reference_model(name, seed, evict_weight):
    run_random_operations(name, seed, num_ops=4000, evict_weight=evict_weight)
