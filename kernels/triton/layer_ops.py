"""Triton kernels for the elementwise work between a decoder layer's products, one launch each.

In torch a Llama layer spends about 32 kernels a decode step: RMSNorm is 8 (cast, square, mean,
add, rsqrt, two multiplies, cast), rotary 5, a residual add and SiLU x up 2 more each. Here:

- `add_rms_norm_(x, residual, weight, eps, offset)`: residual += x in place (the product that ends
  the block before), then the RMSNorm of that sum, in one pass over the row. x None: the norm only.
- `rotary_(x, positions, cos_table, sin_table, dims)`: rotates the leading `dims` of each head of
  x [T, heads, head_dim] in place (NeoX's half-split layout), cos and sin read from the tables at
  each token's position, so no per-step gather.
- `silu_mul(gate_up)`: SiLU(gate) * up of a fused [T, 2I] projection, gate first.

Each rounds where the torch modules they replace round (models/llama.py's RMSNorm and MLP,
kernels/rotary.py): the residual sum to the activations' dtype, the normalized row to it before the
weight multiplies (Gemma's `offset`: the weight plus offset in float32, rounded once), cos and sin
to it before they multiply, each product and sum to it. Rounding to bfloat16 is done in integers
(`kv_cache_write._round_to_bf16`), as the interpreter truncates that cast. What can differ from torch
is the order of the norm's sum of squares, and on a GPU the last bits of `exp`: the tests bound
both against the torch modules, natively and under Triton's interpreter.

The grids and arguments come from shapes, never from tensor values, so every launch can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton.kv_cache_write import _round_to_bf16
from cadenza.kernels.triton.paged_attention import _sum  # tl.sum is interpreted only under TRITON_INTERPRET at import

# The activations' dtype, as the kernels' ROUND argument: how a float32 result is rounded back.
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """float32 x rounded to the activations' dtype (kept in float32 for the next operation)."""
    if ROUND == 1:
        return _round_to_bf16(x).to(tl.float32)
    if ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps, offset,
                         HAS_X: tl.constexpr, HAS_OFFSET: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        h = _round_to(h + tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32), ROUND)
        tl.store(residual_ptr + row * stride_r + cols, h, mask=mask)
    inv = 1.0 / tl.sqrt(_sum(h * h, 0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:  # Gemma: (x * (offset + w)) in float32, rounded once
        y = _round_to(h * inv * (offset + w), ROUND)
    else:  # weight * x.to(dtype): the normalized row rounded, then the product rounded
        y = _round_to(w * _round_to(h * inv, ROUND), ROUND)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def add_rms_norm_(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  offset: float = 0.0) -> torch.Tensor:
    """RMSNorm(residual + x) [T, H], a new tensor, with residual += x written in place first
    (x None: RMSNorm(residual), residual untouched). Rows contiguous; x, residual and the result in
    one dtype (float32, bfloat16 or float16); `offset`: Gemma's (1 + w)."""
    rows, cols = residual.shape
    if residual.stride(-1) != 1 or (x is not None and (x.stride(-1) != 1 or x.dtype != residual.dtype)):
        raise ValueError("add_rms_norm_ needs rows of contiguous values and x in the residual's dtype")
    out = torch.empty_like(residual)
    if rows == 0:
        return out
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](
        x if x is not None else residual, residual, weight, out,
        x.stride(0) if x is not None else 0, residual.stride(0), out.stride(0), cols, eps, offset,
        HAS_X=x is not None, HAS_OFFSET=offset != 0.0, ROUND=_ROUND[residual.dtype], BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_table,
                   HALF: tl.constexpr, ROUND: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    base = x_ptr + token * stride_t + head * stride_h
    first = tl.load(base + dims).to(tl.float32)
    second = tl.load(base + HALF + dims).to(tl.float32)
    # The table repeats its frequencies in both halves: cos[d] == cos[HALF + d].
    cos = _round_to(tl.load(cos_ptr + position * stride_table + dims), ROUND)
    sin = _round_to(tl.load(sin_ptr + position * stride_table + dims), ROUND)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them.
    out_first = _round_to(_round_to(first * cos, ROUND) + _round_to(-second * sin, ROUND), ROUND)
    out_second = _round_to(_round_to(second * cos, ROUND) + _round_to(first * sin, ROUND), ROUND)
    tl.store(base + dims, out_first)
    tl.store(base + HALF + dims, out_second)


def rotates(dims: int) -> bool:
    """Whether `rotary_` can rotate `dims` dimensions: an even number whose half is a power of two."""
    half = dims // 2
    return dims % 2 == 0 and half > 0 and not half & (half - 1)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
            dims: int | None = None) -> torch.Tensor:
    """x [T, heads, head_dim] with the leading `dims` (all by default) of each head rotated in
    place, NeoX's half-split layout, at `positions` [T]; the tables [positions, dims] float32
    (models/rotary.py's). Returns x."""
    tokens, heads, head_dim = x.shape
    dims = head_dim if dims is None else dims
    if x.stride(-1) != 1 or dims > head_dim or cos_table.shape[-1] != dims:
        raise ValueError(f"rotary_ needs contiguous head dimensions and tables of the {dims} rotated ones")
    if not rotates(dims):
        raise ValueError(f"rotary_ rotates an even number of dimensions with a power-of-two half, not {dims}")
    half = dims // 2
    if tokens and heads:
        _rotary_kernel[(tokens, heads)](x, positions, cos_table, sin_table, x.stride(0), x.stride(1),
                                        cos_table.stride(0), HALF=half, ROUND=_ROUND[x.dtype], num_warps=1)
    return x


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, width, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round_to(gate / (1.0 + tl.exp(-gate)), ROUND)  # F.silu in float32, rounded to the dtype
    tl.store(out_ptr + row * stride_o + cols, _round_to(silu * up, ROUND), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up [T, I] of a fused gate_up [T, 2I] (gate first), a new tensor."""
    rows, both = gate_up.shape
    if gate_up.stride(-1) != 1 or both % 2:
        raise ValueError("silu_mul needs a [rows, 2 * intermediate] product with contiguous rows")
    width = both // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                            ROUND=_ROUND[gate_up.dtype], BLOCK=block, num_warps=4)
    return out
