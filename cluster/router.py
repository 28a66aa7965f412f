"""Which data-parallel replica serves a request (plain logic: no processes, no I/O).

`prefix` (the default) sends a request to the replica whose prefix cache most likely holds the
longest part of its prompt: the router computes the chained block hashes the cache manager uses
(`actors.cache_manager.prompt_hashes`) on the prompt token ids and keeps, per replica, an approximate
index of the hashes it routed there (least recently routed dropped first past the replica's block
count). So a session's or conversation's turns, each prompt extending the last, go where their
history is cached. Without a match, or when the best match's replica is `max_imbalance` requests
busier than the least loaded one, the least loaded replica wins. `round_robin` and `least_loaded`
ignore prompts. A disaggregated deployment routes each request twice, among its prefill
replicas and among its decode replicas (`among`), by the same policy.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from cadenza.actors.cache_manager import prompt_hashes

POLICIES = ("prefix", "round_robin", "least_loaded")


@dataclass
class ReplicaStats:
    """What the router knows of one replica: requests in flight, routed, and predicted cache hits."""

    in_flight: int = 0
    routed: int = 0
    matched_blocks: int = 0  # prompt blocks the router expected to find in this replica's cache
    prompt_blocks: int = 0  # full prompt blocks routed here
    alive: bool = True


class Router:
    def __init__(
        self, num_replicas: int, block_size: int, policy: str = "prefix", capacity_blocks: int = 1 << 16, max_imbalance: int = 8
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(POLICIES)}")
        self.block_size = block_size
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        self.max_imbalance = max_imbalance
        self.stats = [ReplicaStats() for _ in range(num_replicas)]
        self._index: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = itertools.cycle(range(num_replicas))

    def route(self, token_ids: Sequence[int], among: Sequence[int] | None = None, salt: str | None = None) -> int:
        """Pick a live replica for a prompt (one of `among`, if given: the prefill or the decode
        replicas of a disaggregated deployment), and count the request as in flight there."""
        candidates = range(len(self.stats)) if among is None else among
        alive = [i for i in candidates if self.stats[i].alive]
        if not alive:
            raise RuntimeError("no data-parallel replica is alive" if among is None else
                               f"none of data-parallel replicas {list(among)} is alive")
        # Salted as the replicas' caches hash it (a request's cache_salt), so it meets only its own.
        hashes = prompt_hashes(token_ids, self.block_size, salt) if self.policy == "prefix" else []
        least = min(alive, key=lambda i: (self.stats[i].in_flight, self.stats[i].routed))
        matched = 0
        if self.policy == "round_robin":
            choice = next(i for i in self._next if i in alive)
        elif self.policy == "least_loaded":
            choice = least
        else:
            matches = {i: self._match(i, hashes) for i in alive}
            best = max(alive, key=lambda i: (matches[i], -self.stats[i].in_flight))
            busy = self.stats[best].in_flight - self.stats[least].in_flight > self.max_imbalance
            choice = best if matches[best] and not busy else least
            matched = matches[choice]
        self._remember(choice, hashes)
        stats = self.stats[choice]
        stats.in_flight += 1
        stats.routed += 1
        stats.matched_blocks += matched
        stats.prompt_blocks += len(hashes)
        return choice

    def finished(self, replica: int) -> None:
        self.stats[replica].in_flight -= 1

    def mark_dead(self, replica: int) -> None:
        """Route nothing more to `replica`; its index is dropped."""
        self.stats[replica].alive = False
        self._index[replica].clear()

    def revive(self, replica: int) -> None:
        """Route to `replica` again (restarted: its cache starts empty, as its index does)."""
        self.stats[replica].alive = True

    def _match(self, replica: int, hashes: list[bytes]) -> int:
        index = self._index[replica]
        count = 0
        for digest in hashes:
            if digest not in index:
                break
            count += 1
        return count

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        index = self._index[replica]
        for digest in hashes:
            index[digest] = None
            index.move_to_end(digest)
        while len(index) > self.capacity_blocks:
            index.popitem(last=False)
