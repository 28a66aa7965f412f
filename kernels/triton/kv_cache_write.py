"""Triton kernels that store a step's new keys and values into the paged KV cache.

One program per token writes that token's keys and values for every kv head. The grid and every
argument come from shapes and strides, never from the values of `slot_mapping`, so the launch can be
captured in a CUDA graph; a padding row (slot -1) is skipped by a store mask inside the kernel.
Both kernels are bit-exact against their torch counterparts (`reference.py`), natively and under
Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even, as torch's `.to()` does.

    Done in integer arithmetic because Triton's interpreter truncates this conversion; the same
    code then gives the same bits natively and interpreted. NaN becomes torch's quiet NaN, 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_half_even(x):
    """Round to the nearest integer, ties to even, as torch's `round()` does, for |x| < 2**22.

    Spelled out with floor because libdevice's rint does not exist under the interpreter."""
    floor = tl.floor(x)
    frac = x - floor  # exact at these magnitudes
    is_odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & is_odd), floor + 1.0, floor)


@triton.jit
def _slot_rows(slot, stride_block, stride_offset, stride_head, num_kv_heads, head_dim,
               BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of one cache slot's [BLOCK_H, BLOCK_D] rows, and their mask: padding heads and dims
    are off, and the whole slot where it is negative."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot writes no head. (Folded into the bound: the interpreter mistypes a block mask
    # and-ed with a scalar one.)
    mask = (heads < tl.where(slot >= 0, num_kv_heads, 0)) & (dims < head_dim)
    offsets = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset + heads * stride_head + dims
    return offsets, mask


@triton.jit
def _token_rows(token, stride_t, stride_h, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of one input token's [BLOCK_H, BLOCK_D] rows."""
    return token.to(tl.int64) * stride_t + tl.arange(0, BLOCK_H)[:, None] * stride_h + tl.arange(0, BLOCK_D)[None, :]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_block, stride_offset, stride_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_TO_BF16: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dst, mask = _slot_rows(slot, stride_block, stride_offset, stride_head, num_kv_heads, head_dim,
                           BLOCK_SIZE, BLOCK_H, BLOCK_D)
    k_src = _token_rows(token, stride_kt, stride_kh, BLOCK_H, BLOCK_D)
    v_src = _token_rows(token, stride_vt, stride_vh, BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + k_src, mask=mask)
    v = tl.load(v_ptr + v_src, mask=mask)
    if ROUND_TO_BF16:
        k = _round_to_bf16(k.to(tl.float32))
        v = _round_to_bf16(v.to(tl.float32))
    # Otherwise the store casts to the cache dtype, rounding to nearest even.
    tl.store(cache_ptr + dst, k, mask=mask)
    tl.store(cache_ptr + stride_kv + dst, v, mask=mask)


@triton.jit
def _quantize_int8(x):
    """x float32 [H, D] (padding zero) -> (values [H, D] float32 integral, scale [H] float16), bit for
    bit `quantize_int8`. Divisions are IEEE (div_rn): Triton's `/` may be approximate on the GPU."""
    # tl.max's own reduction, called without tl.max: see _max in paged_attention.py for why.
    absmax = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max)
    scale = tl.minimum(tl.math.div_rn(absmax, 127.0), 65504.0).to(tl.float16)
    divisor = tl.where(scale == 0.0, 1.0, scale.to(tl.float32))
    scaled = tl.math.div_rn(x, divisor[:, None])
    # Clamping first keeps the rounding's operand small; it commutes with rounding at integer bounds.
    values = _round_half_even(tl.minimum(tl.maximum(scaled, -127.0), 127.0))
    return values, scale


@triton.jit
def _write_kv_int8_kernel(
    k_ptr, v_ptr, data_ptr, scales_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_block, stride_offset, stride_head,
    scale_stride_kv, scale_stride_block, scale_stride_offset, scale_stride_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dst, mask = _slot_rows(slot, stride_block, stride_offset, stride_head, num_kv_heads, head_dim,
                           BLOCK_SIZE, BLOCK_H, BLOCK_D)
    k_src = _token_rows(token, stride_kt, stride_kh, BLOCK_H, BLOCK_D)
    v_src = _token_rows(token, stride_vt, stride_vh, BLOCK_H, BLOCK_D)
    heads = tl.arange(0, BLOCK_H)
    scale_dst = (slot // BLOCK_SIZE) * scale_stride_block + (slot % BLOCK_SIZE) * scale_stride_offset
    scale_dst += heads * scale_stride_head
    scale_mask = heads < tl.where(slot >= 0, num_kv_heads, 0)

    k_values, k_scale = _quantize_int8(tl.load(k_ptr + k_src, mask=mask, other=0.0).to(tl.float32))
    tl.store(data_ptr + dst, k_values.to(tl.int8), mask=mask)
    tl.store(scales_ptr + scale_dst, k_scale, mask=scale_mask)
    v_values, v_scale = _quantize_int8(tl.load(v_ptr + v_src, mask=mask, other=0.0).to(tl.float32))
    tl.store(data_ptr + stride_kv + dst, v_values.to(tl.int8), mask=mask)
    tl.store(scales_ptr + scale_stride_kv + scale_dst, v_scale, mask=scale_mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, num_kv_heads, head_dim] at flat slots `slot_mapping` [T] (int32 or int64) of
    `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim], cast to the cache dtype (round to
    nearest even, as `.to()`). k and v may be strided views whose last dim has unit stride. Rows whose
    slot is negative (padding rows of a CUDA-graph batch) are skipped."""
    _check_rows(k, v, kv_cache)
    if k.shape[0] == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    _write_kv_kernel[(k.shape[0],)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *kv_cache.stride()[:4],
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROUND_TO_BF16=kv_cache.dtype == torch.bfloat16 and k.dtype != torch.bfloat16,
    )


def write_kv_cache_int8(
    k: torch.Tensor, v: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The same for an int8 cache (`Int8KVCache`'s `data` int8 [2, num_blocks, block_size,
    num_kv_heads, head_dim] and `scales` float16 [2, num_blocks, block_size, num_kv_heads]): each
    (token, kv head) row quantized bit for bit as `attention_backends.base.quantize_int8` does."""
    _check_rows(k, v, data)
    if k.shape[0] == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = data.shape
    _write_kv_int8_kernel[(k.shape[0],)](
        k, v, data, scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *data.stride()[:4],
        *scales.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _check_rows(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> None:
    """Shape and stride checks only: nothing here reads a tensor's values."""
    if k.shape != v.shape or k.shape[1:] != cache.shape[3:]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match the cache {tuple(cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("k, v and the cache need a unit stride in their last (head_dim) dimension")
