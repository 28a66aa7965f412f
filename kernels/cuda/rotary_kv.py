"""Rotary embedding of q and k fused with the KV-cache write: one cupy kernel (rotary_kv.cu), else torch.

The contract of both functions, for one step's T tokens:
- q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] in one activation dtype (float32, bfloat16 or
  float16), head_dim D even; the last dimension contiguous, any token and head strides (views of a
  fused qkv projection are fine).
- positions [T] integer, each in [0, max_positions); cos_table and sin_table [max_positions, D]
  float32: `RotaryEmbedding`'s buffers (models/rotary.py).
- q and k are rotated in place (the half-split, NeoX layout): what
  `apply_rotary(x, *embedding.cos_sin(positions, x.dtype))` returns, bit for bit on the kernel
  path (cos and sin cast to the activation dtype first, as transformers does).
- Then the rotated k and v are stored at the flat slots `slot_mapping` [T] integer
  (block * block_size + offset) of the paged cache, as attention_backends/base.py's `write_kv`
  stores them: converted to the cache's dtype, or quantized a (token, kv head) row at a time as
  `quantize_int8` does for the int8 cache (bit for bit as it runs on the GPU: PyTorch's CUDA
  divides by 127 by multiplying by 1/127, its CPU by dividing, so a scale computed on the CPU may
  differ in its last bit). A negative slot marks a padding row: its q and k are rotated all the
  same, its k and v are not stored.
- Nothing is returned. Inconsistent shapes raise ValueError before anything is touched.

The kernel runs where every tensor is on one CUDA device, the cache is contiguous and cupy's
kernels are available (kernels/cuda/loader.py); its launch has no host sync, so it can be captured in a
CUDA graph once compiled. Elsewhere the torch fallback runs (`apply_rotary`, then `write_kv`):
it asks on the host whether any slot is negative, a sync, so it is not for capture.
"""

from __future__ import annotations

import numpy as np
import torch

from cadenza.kernels.cuda import loader
from cadenza.kernels.kv_layout import KV_SCALE_DTYPE, Int8KVCache, write_kv
from cadenza.kernels.rotary import apply_rotary

SOURCE = "rotary_kv.cu"
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
KERNELS = tuple(
    [f"rotary_kv_{a}_{c}" for a in _DTYPE_NAMES.values() for c in _DTYPE_NAMES.values()]
    + [f"rotary_kv_int8_{a}" for a in _DTYPE_NAMES.values()]
)
MAX_WARPS = 8  # a block's warps; a token's Hq + 2 Hkv rows are shared out among them


def rotary_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place, then store k and v in `kv_cache` [2, num_blocks, block_size, Hkv, D]
    (float32, bfloat16 or float16) at `slot_mapping`: see the module docstring."""
    _check(q, k, v, positions, cos_table, sin_table, kv_cache.shape, slot_mapping)
    if kv_cache.dtype in _DTYPE_NAMES and kv_cache.is_contiguous():
        kernels = _kernels(q, k, v, positions, cos_table, sin_table, kv_cache, slot_mapping)
        if kernels is not None:
            name = f"rotary_kv_{_DTYPE_NAMES[q.dtype]}_{_DTYPE_NAMES[kv_cache.dtype]}"
            _launch(kernels[name], q, k, v, positions, cos_table, sin_table, (kv_cache,), slot_mapping)
            return
    _rotate(q, k, positions, cos_table, sin_table)
    _write(k, v, kv_cache, slot_mapping)


def rotary_and_write_kv_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """As `rotary_and_write_kv`, into an `Int8KVCache`'s tensors: `data` int8
    [2, num_blocks, block_size, Hkv, D] and `scales` float16 [2, num_blocks, block_size, Hkv]."""
    _check(q, k, v, positions, cos_table, sin_table, data.shape, slot_mapping)
    if data.dtype != torch.int8 or scales.dtype != KV_SCALE_DTYPE or scales.shape != data.shape[:-1]:
        raise ValueError(f"data must be int8 [2, blocks, block_size, Hkv, D] and scales {KV_SCALE_DTYPE} of its shape less D")
    if data.is_contiguous() and scales.is_contiguous():
        kernels = _kernels(q, k, v, positions, cos_table, sin_table, data, scales, slot_mapping)
        if kernels is not None:
            name = f"rotary_kv_int8_{_DTYPE_NAMES[q.dtype]}"
            _launch(kernels[name], q, k, v, positions, cos_table, sin_table, (data, scales), slot_mapping)
            return
    _rotate(q, k, positions, cos_table, sin_table)
    _write(k, v, Int8KVCache(data, scales), slot_mapping)


def _check(q, k, v, positions, cos_table, sin_table, cache_shape, slot_mapping) -> None:
    if q.dim() != 3:
        raise ValueError("q must be [T, Hq, D]")
    tokens, _, dim = q.shape
    kv_shape = (tokens, cache_shape[3], dim)
    problems = [
        (q.dtype not in _DTYPE_NAMES or k.dtype != q.dtype or v.dtype != q.dtype, "q, k, v must share a float32, bfloat16 or float16 dtype"),
        (tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape, f"k and v must be [T, Hkv, D] = {list(kv_shape)}"),
        (dim % 2 or len(cache_shape) != 5 or cache_shape[0] != 2 or cache_shape[4] != dim, "the cache must be [2, blocks, block_size, Hkv, D], D even"),
        (positions.shape != (tokens,) or slot_mapping.shape != (tokens,), "positions and slot_mapping must be [T]"),
        (cos_table.dim() != 2 or cos_table.shape != sin_table.shape or cos_table.shape[1] != dim, "cos and sin tables must be [max_positions, D]"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(message)


def _kernels(q, k, v, positions, cos_table, sin_table, *rest) -> dict | None:
    device = q.device
    usable = (
        device.type == "cuda"
        and q.shape[0] > 0
        and all(t.device == device for t in (k, v, positions, cos_table, sin_table, *rest))
        and all(t.stride(-1) == 1 for t in (q, k, v))
        and cos_table.dtype == sin_table.dtype == torch.float32
        and cos_table.is_contiguous()
        and sin_table.is_contiguous()
    )
    return loader.kernels_for(SOURCE, KERNELS, device) if usable else None


def _launch(kernel, q, k, v, positions, cos_table, sin_table, cache: tuple, slot_mapping) -> None:
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    num_slots = cache[0].shape[1] * cache[0].shape[2]
    # int64 on the kernel's side; a no-op for the runner's own int64 tensors.
    positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    c = loader.as_cupy
    args = (
        c(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
        c(k), np.int64(k.stride(0)), np.int64(k.stride(1)),
        c(v), np.int64(v.stride(0)), np.int64(v.stride(1)),
        c(positions), c(cos_table), c(sin_table), np.int64(cos_table.shape[0]),
        *(c(t) for t in cache), np.int64(num_slots), c(slot_mapping),
        np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(dim),
    )
    # Grid: one block a token; its warps share out the token's q, k and v rows (rotary_kv.cu).
    warps = min(MAX_WARPS, num_q_heads + 2 * num_kv_heads)
    loader.launch(kernel, (tokens,), (32 * warps,), args, q.device)


def _rotate(q, k, positions, cos_table, sin_table) -> None:
    # What RotaryEmbedding.cos_sin looks up, cast as it casts.
    cos = cos_table[positions].to(q.dtype).unsqueeze(1)
    sin = sin_table[positions].to(q.dtype).unsqueeze(1)
    q.copy_(apply_rotary(q, cos, sin))
    k.copy_(apply_rotary(k, cos, sin))


def _write(k, v, cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding rows: store only the others
        rows = keep.nonzero().squeeze(1)
        k, v, slot_mapping = k.index_select(0, rows), v.index_select(0, rows), slot_mapping.index_select(0, rows)
    write_kv(k, v, cache, slot_mapping.to(torch.int64))
