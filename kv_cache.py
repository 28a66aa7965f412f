"""KV cache memory: how many blocks fit a budget, and the per-layer block tensors.

A cache dtype of `torch.int8` means the quantized cache (`Int8KVCache`): int8 keys and values with
a float16 scale per token and kv head, 66 bytes a 64-wide head row against 128 in bfloat16.
"""

from __future__ import annotations

import torch

from cadenza.attention_backends.base import KV_SCALE_DTYPE, Int8KVCache
from cadenza.models.config import ModelArchConfig

DEFAULT_MEMORY_BUDGET = 1 << 30  # 1 GiB when the deployment names neither blocks nor budget


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of `block_size` tokens across all layers (with their scales, for int8)."""
    row = arch.head_dim * dtype.itemsize  # one token's one kv head
    if dtype == torch.int8:
        row += KV_SCALE_DTYPE.itemsize
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * row


def choose_num_blocks(
    arch: ModelArchConfig,
    block_size: int,
    dtype: torch.dtype,
    *,
    num_blocks: int | None,
    memory_budget: int | None,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Blocks from config, else from the budget, never more than every sequence at full length needs."""
    if num_blocks is not None:
        return num_blocks
    per_block = bytes_per_block(arch, block_size, dtype)
    if memory_budget is not None:
        blocks = memory_budget // per_block
        if blocks < 1:
            raise ValueError(f"cache.memory_budget={memory_budget} bytes holds no block of {per_block} bytes")
        return int(blocks)
    most_useful = max_num_seqs * -(-max_model_len // block_size)
    return int(max(1, min(DEFAULT_MEMORY_BUDGET // per_block, most_useful)))


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor] | list[Int8KVCache]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (an `Int8KVCache` of
    that shape and its scales, for int8).

    Zeroed, not empty: attention multiplies masked-out slots by a zero weight, and 0 * NaN from
    uninitialised memory would still be NaN.
    """
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if dtype == torch.int8:
        return [
            Int8KVCache(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape[:4], dtype=KV_SCALE_DTYPE, device=device)
            )
            for _ in range(arch.num_layers)
        ]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
