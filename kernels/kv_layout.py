"""The paged KV cache's layout in memory, and its reads and writes in torch: the reference that
every kernel writing or reading the cache (CPU, Triton, CUDA) matches.

A layer's cache is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]: keys, then values;
a token's flat slot is block * block_size + offset. With `cache.dtype: int8` it is an
`Int8KVCache`: the same layout in int8, and a scale per slot and kv head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The float caches the CPU decode kernels read and write in place (besides an Int8KVCache).
KERNEL_FLOAT_CACHES = (torch.float32, torch.bfloat16, torch.float16)
KV_SCALE_DTYPE = torch.float16  # 2 bytes a (token, kv head): 66 bytes a 64-wide head, not 128 in bf16


@dataclass(slots=True)
class Int8KVCache:
    """One layer's keys and values in int8, symmetric per token and kv head: a row is
    `data * scale`, its scale `absmax / 127`."""

    data: torch.Tensor  # int8 [2, num_blocks, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor  # KV_SCALE_DTYPE [2, num_blocks, block_size, num_kv_heads]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as (int8 [..., D], scale [...] in KV_SCALE_DTYPE): symmetric, absmax / 127 a row.

    Rounded with the stored (float16) scale itself, so `data * scale` is within half a step of x."""
    x = x.float()
    # float16's largest finite value bounds the scale; an all-zero row gets scale 0 and zeros.
    scale = (x.abs().amax(-1) / 127).clamp(max=65504.0).to(KV_SCALE_DTYPE)
    divisor = scale.float().masked_fill(scale == 0, 1.0).unsqueeze(-1)
    return (x / divisor).round().clamp(-127, 127).to(torch.int8), scale


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | Int8KVCache, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values at their slots (quantized, for an `Int8KVCache`)."""
    if isinstance(kv_cache, Int8KVCache):
        _, num_blocks, block_size, heads, dim = kv_cache.data.shape
        data = kv_cache.data.view(2, num_blocks * block_size, heads, dim)
        scales = kv_cache.scales.view(2, num_blocks * block_size, heads)
        for i, x in enumerate((k, v)):
            values, scale = quantize_int8(x)
            data[i].index_copy_(0, slot_mapping, values)
            scales[i].index_copy_(0, slot_mapping, scale)
        return
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def read_kv(
    kv_cache: torch.Tensor | Int8KVCache, slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [len(slots), num_kv_heads, head_dim] in `dtype` at flat cache slots, de-quantized
    for an `Int8KVCache`."""
    if isinstance(kv_cache, Int8KVCache):
        _, _, _, heads, dim = kv_cache.data.shape
        data, scales = kv_cache.data.view(2, -1, heads, dim), kv_cache.scales.view(2, -1, heads, 1)
        keys, values = (
            data[i].index_select(0, slots).to(dtype).mul_(scales[i].index_select(0, slots).to(dtype)) for i in (0, 1)
        )
        return keys, values
    _, _, _, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, -1, heads, dim)
    return flat[0].index_select(0, slots).to(dtype), flat[1].index_select(0, slots).to(dtype)
