"""Triton kernels for attention over the paged KV cache: split-KV decode and causal prefill.

Both walk a sequence's keys in tiles of BLOCK_N tokens, finding each token's cache slot through the
block table (so any block size from 1 up works), and keep an online softmax in float32 in base 2
(scores pre-multiplied by log2(e), so exp2 serves). Int8 caches are de-quantized exactly in-kernel:
a key's scale multiplies its column of q.k^T, a value's scale its column of p, which keeps the dot
products on the raw integers. Grids and launch arguments come from shapes and host ints only; loop
bounds are loaded inside the kernels, which makes the decode launch safe to capture in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl


# The kernels call no function that triton.language defines with @triton.jit (tl.max, tl.sum,
# tl.zeros): those are interpreted only if TRITON_INTERPRET was on when triton was first imported,
# and torch or a test may import it earlier. tl.reduce over the standard library's combine functions
# is what tl.max and tl.sum compile to, and the interpreter recognizes them and reduces in numpy.
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _tile_rows(block_table_row, stride_btc, tokens, token_mask, kv_head, stride_block, stride_offset, stride_head,
               BLOCK_SIZE: tl.constexpr):
    """Offsets of `tokens` [BLOCK_N] (one sequence) for one kv head, in a tensor with the given
    block, in-block offset and head strides; a masked token gets block 0, never dereferenced."""
    blocks = tl.load(block_table_row + (tokens // BLOCK_SIZE) * stride_btc, mask=token_mask, other=0).to(tl.int64)
    return blocks * stride_block + (tokens % BLOCK_SIZE) * stride_offset + kv_head * stride_head


@triton.jit
def _load_tile(cache_ptr, rows, token_mask, dims, dim_mask, DOT_DTYPE: tl.constexpr):
    """Keys or values at `rows` [BLOCK_N] as [BLOCK_N, BLOCK_D] in DOT_DTYPE; masked tokens and
    padding dims read as zero."""
    tile = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=token_mask[:, None] & dim_mask[None, :], other=0)
    return tile.to(DOT_DTYPE)


@triton.jit
def _softmax_step(m_i, l_i, scores):
    """One tile of the online softmax: scores [M, BLOCK_N] in log2 units, -inf where masked.
    Returns the new running max and sum, the factor rescaling the old accumulator, and p."""
    m_new = tl.maximum(m_i, _max(scores, 1))
    # A row that has seen no key yet keeps max -inf; measuring from 0 keeps its p and alpha at 0
    # where -inf - -inf would give NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    return m_new, l_i * alpha + _sum(p, 1), alpha, p


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_table_row, stride_btc,
                 tokens, token_mask, visible, dims, dim_mask, kv_head, qk_scale,
                 stride_block, stride_offset, stride_head, scale_stride_block, scale_stride_offset, scale_stride_head,
                 BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fold one key tile into (m_i, l_i, acc) for the query rows `q` [M, BLOCK_D]; `visible`
    [M, BLOCK_N] says which row may see which key."""
    rows = _tile_rows(block_table_row, stride_btc, tokens, token_mask, kv_head,
                      stride_block, stride_offset, stride_head, BLOCK_SIZE)
    k = _load_tile(k_cache_ptr, rows, token_mask, dims, dim_mask, DOT_DTYPE)
    # "ieee" only matters for float32 operands, which would otherwise be rounded to tf32.
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if IS_INT8:
        scale_rows = _tile_rows(block_table_row, stride_btc, tokens, token_mask, kv_head,
                                scale_stride_block, scale_stride_offset, scale_stride_head, BLOCK_SIZE)
        scores *= tl.load(k_scales_ptr + scale_rows, mask=token_mask, other=0.0).to(tl.float32)[None, :]
    m_i, l_i, alpha, p = _softmax_step(m_i, l_i, tl.where(visible, scores, float("-inf")))
    if IS_INT8:
        p *= tl.load(v_scales_ptr + scale_rows, mask=token_mask, other=0.0).to(tl.float32)[None, :]
    v = _load_tile(v_cache_ptr, rows, token_mask, dims, dim_mask, DOT_DTYPE)
    acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sinks_ptr, qk_scale, sliding_window, head_dim,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_bt, stride_btc,
    stride_block, stride_offset, stride_head, scale_stride_block, scale_stride_offset, scale_stride_head,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr, WRITE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Grid (batch, kv head, split): the GQA group's query heads, packed as the rows of the dot so one
    key tile serves them all, over this split's share of the keys. Writes the split's normalized
    output and, when splitting, its log2-sum-exp (-inf for an empty split). With sinks (a logit per
    head, in log2 units once scaled by log2(e)), split 0 starts its softmax from the sink: a term
    e^sink in the denominator with no value behind it, counted once however the keys split."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)  # one index type for the loop bounds
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    group_rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group_rows
    head_mask = group_rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0)
    q = q.to(DOT_DTYPE)

    # The query sits at seq_len - 1 and sees keys down to seq_len - sliding_window.
    window_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    # The splits share the keys this row sees, in whole tiles: sized from the row's own length
    # (loaded here, so a captured graph splits each replay's rows as they are), not from the
    # block table's width, which a graph's static tables make as long as max_model_len.
    span = seq_len - window_start
    num_splits = tl.num_programs(2)
    tiles_per_split = ((span + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N  # tl.cdiv is @jit: see _max
    tokens_per_split = tiles_per_split * BLOCK_N
    start = window_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        first = head_mask & (split == 0)
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        visible = head_mask[:, None] & token_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                                     block_table_row, stride_btc, tokens, token_mask, visible, dims, dim_mask, kv_head, qk_scale,
                                     stride_block, stride_offset, stride_head,
                                     scale_stride_block, scale_stride_offset, scale_stride_head,
                                     BLOCK_SIZE, IS_INT8, DOT_DTYPE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or seq_len 0) writes zeros
    out_rows = seq.to(tl.int64) * stride_ob + heads * stride_oh + split * stride_os
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out, mask=q_mask)
    if WRITE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _combine_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, num_splits, head_dim,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (batch, head): the splits' outputs weighted by their share of the softmax's sum."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
    lse_max = _max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    total = _sum(weights, 0)
    partial_rows = seq * stride_pb + head * stride_ph + splits * stride_ps
    partial = tl.load(partial_ptr + partial_rows[:, None] + dims[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = _sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out, mask=dim_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, out_ptr, sinks_ptr,
    qk_scale, sliding_window, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_btc,
    stride_block, stride_offset, stride_head, scale_stride_block, scale_stride_offset, scale_stride_head,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (sequence, head, query tile): BLOCK_M query rows of one head, causal over the cache;
    with sinks, each row's softmax starts from its head's sink (see `_decode_kernel`)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)  # one index type for the loop bounds
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - query_start
    if first_row >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = seq_len - query_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    token_rows = (query_start + rows).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0)
    q = q.to(DOT_DTYPE)

    # Keys from the first row's window start to the last row's own position.
    end = seq_len - query_len + tl.minimum(first_row + BLOCK_M, query_len)
    start = tl.where(sliding_window > 0, tl.maximum(seq_len - query_len + first_row - sliding_window + 1, 0), 0)
    lowest_visible = tl.where(sliding_window > 0, positions - sliding_window, -1)  # [BLOCK_M], exclusive
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        visible = (tokens[None, :] <= positions[:, None]) & (tokens[None, :] > lowest_visible[:, None])
        visible = visible & row_mask[:, None] & token_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                                     block_table_row, stride_btc, tokens, token_mask, visible, dims, dim_mask, kv_head, qk_scale,
                                     stride_block, stride_offset, stride_head,
                                     scale_stride_block, scale_stride_offset, scale_stride_head,
                                     BLOCK_SIZE, IS_INT8, DOT_DTYPE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], out, mask=q_mask)


# Whether these kernels run under Triton's interpreter (TRITON_INTERPRET=1 when they were defined).
_INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query row per sequence over its paged keys and values (flash-decoding).

    Args:
        q: [B, num_heads, head_dim]; row b sits at position seq_lens[b] - 1.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0] and
            kv_cache[1]); for an int8 cache the data views, with `k_scales`/`v_scales` float16
            [num_blocks, block_size, num_kv_heads].
        block_tables: [B, max_blocks] int32 or int64, any strides (the CUDA-graph buffer holds it
            column-major, so a step sends only the columns its sequences use).
        seq_lens: [B] int32 or int64: row b attends keys 0 .. seq_lens[b] - 1, and only those at
            positions > seq_lens[b] - 1 - sliding_window where sliding_window > 0.
        num_splits: how many programs share one row's keys; each takes an equal share, in whole
            tiles, of the keys the row sees (sized in the kernel from its seq_len, so a short row
            in a wide table still spreads over the splits). Above 1, a second kernel combines them.
        out: where to write the result (any strides, unit in the last dim).
        sinks: float32 [num_heads] or None (gpt-oss): each head's logit in every softmax's
            denominator, with no value behind it.

    Returns [B, num_heads, head_dim] in q's dtype; a row with seq_lens 0 gets zeros. The grid and
    every launch argument depend on shapes and `num_splits` only (CUDA-graph safe)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check_inputs(q, key_cache, value_cache, k_scales, v_scales)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, not {num_splits}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    tiles = _tiles(q.dtype, key_cache.dtype, head_dim)
    if num_splits == 1:
        partial, lse, partial_split_stride = out, out, 0  # lse unused: WRITE_LSE is off
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_split_stride = partial.stride(2)
    k_scales_arg, v_scales_arg, scale_strides = _scale_args(key_cache, k_scales, v_scales)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, key_cache, value_cache, k_scales_arg, v_scales_arg, block_tables, seq_lens, partial, lse,
        q if sinks is None else sinks, scale * math.log2(math.e), sliding_window, head_dim,
        q.stride(0), q.stride(1), partial.stride(0), partial.stride(1), partial_split_stride,
        lse.stride(0), lse.stride(1), block_tables.stride(0), block_tables.stride(1),
        *key_cache.stride()[:3], *scale_strides,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d, BLOCK_SIZE=block_size, IS_INT8=k_scales is not None,
        DOT_DTYPE=tiles.dot_dtype, WRITE_LSE=num_splits > 1, HAS_SINKS=sinks is not None, num_warps=tiles.num_warps,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            partial, lse, out, num_splits, head_dim,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=tiles.block_d,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int = 0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for any mix of prefills, extends over a cached prefix, and decodes.

    Args:
        q: [T, num_heads, head_dim] flattened; sequence i owns rows
            query_start_loc[i]:query_start_loc[i+1] ([B + 1], int32 or int64), its newest tokens,
            at positions seq_lens[i] - q_len_i .. seq_lens[i] - 1. Every key and value, the new ones
            included, is already in the cache.
        max_query_len: a host int bounding every q_len_i; it sizes the grid.
        The rest as for `paged_decode_attention`.

    Returns [T, num_heads, head_dim] in q's dtype: each row attends the keys at positions up to
    its own (and within `sliding_window` when it is > 0)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check_inputs(q, key_cache, value_cache, k_scales, v_scales)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    tiles = _tiles(q.dtype, key_cache.dtype, head_dim)
    k_scales_arg, v_scales_arg, scale_strides = _scale_args(key_cache, k_scales, v_scales)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, tiles.block_m))](
        q, key_cache, value_cache, k_scales_arg, v_scales_arg, block_tables, query_start_loc, seq_lens, out,
        q if sinks is None else sinks, scale * math.log2(math.e), sliding_window, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.stride(1),
        *key_cache.stride()[:3], *scale_strides,
        GROUP=num_heads // num_kv_heads, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d, BLOCK_SIZE=block_size, IS_INT8=k_scales is not None,
        DOT_DTYPE=tiles.dot_dtype, HAS_SINKS=sinks is not None, num_warps=tiles.num_warps,
    )
    return out


class _Tiles(NamedTuple):
    block_m: int  # prefill query rows a program
    block_n: int  # keys a tile
    block_d: int  # head_dim padded to a power of two, at least 16 (tl.dot's smallest inner dimension)
    num_warps: int
    dot_dtype: object  # the tl dtype of the dots' operands (they accumulate in float32)


def _tiles(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> _Tiles:
    """Tile sizes and dot operand dtype, chosen by ptxas's spill report for sm_90 (not timed: no
    autotuning yet).

    The dots take a 16-bit cache's own dtype (tensor cores), q's for an int8 cache (its integers
    are exact in any float) and float32 otherwise. Float32 dots run on FMA units, their operands
    in registers: 64-key tiles spilled kilobytes, 16-key tiles nothing. 16-bit tiles of 64 keys
    spilled 100-300 bytes with 4 warps and nothing with 8 at head_dim 64 and 128 (a padded
    head_dim such as 80 still spills a few bytes)."""
    if cache_dtype == torch.int8:
        dtype = q_dtype if q_dtype in (torch.float16, torch.bfloat16) else torch.float32
    else:
        dtype = cache_dtype
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_m, block_n, num_warps = 16, 16, 4 if block_d <= 128 else 8
    elif block_d <= 128:
        block_m, block_n, num_warps = 64, 64, 8
    else:
        block_m, block_n, num_warps = 32, 32, 8
    if _INTERPRETED and dtype == torch.bfloat16:
        dtype = torch.float32  # the interpreter holds bfloat16 as raw uint16 bits: numpy has no bf16 math
    return _Tiles(block_m, block_n, block_d, num_warps, _TL_DTYPES[dtype])


def _scale_args(cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None):
    """(k_scales, v_scales, their three strides): for a float cache, placeholders the kernel never reads."""
    if k_scales is None:
        return cache, cache, (0, 0, 0)
    return k_scales, v_scales, k_scales.stride()


def _check_inputs(q, key_cache, value_cache, k_scales, v_scales) -> None:
    """Shape, dtype and stride checks only: nothing here reads a tensor's values."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_dim = key_cache.shape[2:]
    if head_dim != cache_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} kv heads of dim {cache_dim}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache need the same shape and strides")
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a unit stride in their last (head_dim) dimension")
    if (key_cache.dtype == torch.int8) != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("an int8 cache takes k_scales and v_scales, and a float cache neither")
    if k_scales is not None and k_scales.stride() != v_scales.stride():
        raise ValueError("k_scales and v_scales need the same strides")
