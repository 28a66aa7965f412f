"""KV cache memory: how many blocks to allocate, and the per-layer block tensors.

A cache dtype of `torch.int8` means the quantized cache (`Int8KVCache`): int8 keys and values with
a float16 scale per token and kv head, 66 bytes a 64-wide head row against 128 in bfloat16.

With neither `cache.num_blocks` nor `cache.memory_budget` set, the cache holds
`scheduler.max_num_seqs` sequences of `TYPICAL_SEQUENCE_TOKENS` tokens (of `max_model_len` where
that is shorter), and at least one sequence of `max_model_len`, within `MEMORY_FRACTION` of the
memory available when the engine starts (Linux's MemAvailable, or CUDA's free memory): longer
sequences than typical wait or are preempted rather than being reserved for up front. For the
default model that is 16,384 tokens, 720 MiB in float32 (its CPU default) and 360 MiB in bfloat16,
where a flat 1 GiB held 23,296 float32 tokens.

A CPU cache is an anonymous mapping: zero pages the kernel backs with memory only when a block is
first written, so a cache that is never filled never becomes resident (an engine that served
short prompts holds the blocks it used, not the budget).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from cadenza.kernels.kv_layout import KV_SCALE_DTYPE, Int8KVCache
from cadenza.models.config import ModelArchConfig

# A typical sequence's share: the default max_tokens. Under steady load the whole cache becomes
# resident (freed blocks go to the back of the free queue), so this sets what a served process grows
# to: 512 would keep twice as many long requests running at once, at twice the memory.
TYPICAL_SEQUENCE_TOKENS = 256
MEMORY_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class CacheSize:
    """How many blocks the cache takes, of how many bytes each, and why that many (for the log)."""

    num_blocks: int
    block_bytes: int
    reason: str

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of `block_size` tokens across all layers (with their scales, for int8)."""
    row = arch.head_dim * dtype.itemsize  # one token's one kv head
    if dtype == torch.int8:
        row += KV_SCALE_DTYPE.itemsize
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * row


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes a new allocation can take on `device` without swapping out others: CUDA's free memory,
    Linux's MemAvailable, else the free physical pages; None where none of these can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def size_cache(
    arch: ModelArchConfig,
    block_size: int,
    dtype: torch.dtype,
    *,
    num_blocks: int | None,
    memory_budget: int | None,
    max_num_seqs: int,
    max_model_len: int,
    available: int | None = None,
) -> CacheSize:
    """The cache's size: `num_blocks`, else `memory_budget` bytes' worth, else the default rule of
    the module docstring over `available` bytes (None: no memory bound)."""
    per_block = bytes_per_block(arch, block_size, dtype)
    if num_blocks is not None:
        return CacheSize(num_blocks, per_block, "cache.num_blocks")
    if memory_budget is not None:
        blocks = memory_budget // per_block
        if blocks < 1:
            raise ValueError(f"cache.memory_budget={memory_budget} bytes holds no block of {per_block} bytes")
        return CacheSize(int(blocks), per_block, f"cache.memory_budget ({memory_budget} bytes)")
    typical = min(max_model_len, TYPICAL_SEQUENCE_TOKENS)
    wanted = max(max_num_seqs * -(-typical // block_size), -(-max_model_len // block_size))
    reason = (f"scheduler.max_num_seqs ({max_num_seqs}) sequences of {typical} tokens"
              if wanted > -(-max_model_len // block_size) else f"one sequence of max_model_len ({max_model_len})")
    if available is not None and wanted * per_block > MEMORY_FRACTION * available:
        bound = max(1, int(MEMORY_FRACTION * available) // per_block)
        return CacheSize(bound, per_block, f"{reason} would pass {MEMORY_FRACTION:.0%} of the "
                         f"{available >> 20} MiB available; cut to that")
    return CacheSize(wanted, per_block, reason)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape`: on the CPU in an anonymous mapping (the kernel's zero pages, made resident
    as they are written), elsewhere `torch.zeros`."""
    numel = torch.Size(shape).numel()
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)  # the tensor keeps the map


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor] | list[Int8KVCache]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (an `Int8KVCache` of
    that shape and its scales, for int8).

    Zeroed, not empty: attention multiplies masked-out slots by a zero weight, and 0 * NaN from
    uninitialised memory would still be NaN.
    """
    device = torch.device(device)
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if dtype == torch.int8:
        return [
            Int8KVCache(_zeros(shape, dtype, device), _zeros(shape[:4], KV_SCALE_DTYPE, device))
            for _ in range(arch.num_layers)
        ]
    return [_zeros(shape, dtype, device) for _ in range(arch.num_layers)]
