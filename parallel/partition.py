"""Which part of each layer a tensor-parallel rank holds (plain arithmetic, no torch).

Attention is split by KV head: each rank holds a contiguous run of KV heads and every query head
of their groups, so attention needs no communication. With more ranks than KV heads, each KV head
is replicated on `world_size / num_kv_heads` ranks, which split that head's query heads. The MLP's
intermediate columns and the vocabulary are split into contiguous runs, as even as possible (a
split need not be exact: the all-reduce sums whatever each rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from cadenza.parallel.errors import ShardingError


def even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) runs covering `total`, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass(frozen=True, slots=True)
class RankPartition:
    """One rank's share: [start, end) runs of query heads, KV heads, MLP columns, vocabulary rows."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def partition(
    *, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, world_size: int, rank: int
) -> RankPartition:
    """Rank `rank`'s share; raises `ShardingError` naming the count that cannot be split."""
    if not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    if num_heads % num_kv_heads:
        raise ShardingError(f"{num_heads} attention heads do not group evenly over {num_kv_heads} KV heads")
    if world_size > num_heads:
        raise ShardingError(f"tensor_parallel_size {world_size} exceeds the model's {num_heads} attention heads")
    if world_size > intermediate_size or world_size > vocab_size:
        raise ShardingError(f"tensor_parallel_size {world_size} exceeds the MLP or vocabulary width")
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv = even_ranges(num_kv_heads, world_size)[rank]
        q = (kv[0] * group, kv[1] * group)
    else:
        # Fewer KV heads than ranks: replicate each KV head on `copies` ranks, which split its queries.
        if world_size % num_kv_heads:
            raise ShardingError(
                f"tensor_parallel_size {world_size} is not a multiple of the model's {num_kv_heads} KV heads "
                "(with more ranks than KV heads, each KV head is replicated on the same number of ranks)"
            )
        copies = world_size // num_kv_heads
        if group % copies:
            raise ShardingError(
                f"the {group} query heads of each KV head do not split over {copies} ranks "
                f"(tensor_parallel_size {world_size}, {num_kv_heads} KV heads)"
            )
        head, part = divmod(rank, copies)
        kv = (head, head + 1)
        width = group // copies
        q = (head * group + part * width, head * group + (part + 1) * width)
    return RankPartition(
        rank=rank,
        world_size=world_size,
        q_heads=q,
        kv_heads=kv,
        intermediate=even_ranges(intermediate_size, world_size)[rank],
        vocab=even_ranges(vocab_size, world_size)[rank],
    )
