"""Pure-torch references of the Triton kernels, with the same signatures.

They are the tests' oracle (run in float64) and the backend's CPU fallback, so they keep the kernels'
launch discipline: no host syncs and no shapes that depend on tensor values (`torch.compile(
fullgraph=True)` traces them, and a CUDA graph could capture them). Attention therefore gathers
every sequence's full block-table width and masks, rather than slicing each sequence to its length.
"""

from __future__ import annotations

import torch

from cadenza.kernels.kv_layout import quantize_int8


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, num_kv_heads, head_dim] cast to the cache dtype and stored at flat slots
    `slot_mapping` [T] of `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous).
    Rows whose slot is negative (padding) are skipped."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    for i, x in enumerate((k, v)):
        _store_rows(flat[i], x.to(kv_cache.dtype), slot_mapping)


def write_kv_cache_int8(
    k: torch.Tensor, v: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The same for an int8 cache: `data` int8 [2, num_blocks, block_size, num_kv_heads, head_dim],
    `scales` float16 [2, num_blocks, block_size, num_kv_heads], rows quantized by `quantize_int8`."""
    _, num_blocks, block_size, heads, dim = data.shape
    flat_data = data.view(2, num_blocks * block_size, heads, dim)
    flat_scales = scales.view(2, num_blocks * block_size, heads)
    for i, x in enumerate((k, v)):
        values, scale = quantize_int8(x)
        _store_rows(flat_data[i], values, slot_mapping)
        _store_rows(flat_scales[i], scale, slot_mapping)


def _store_rows(flat: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`flat[slot_mapping[t]] = rows[t]` for every t with a non-negative slot, without a host sync.

    Boolean indexing would give a data-dependent shape, and clamping padding slots to 0 would race
    with a real write to slot 0 (index_copy_ picks no winner among duplicates). So every padding row
    is redirected to repeat the first valid row's write, same slot and same value, which makes the
    duplicates harmless; when no row is valid they all rewrite slot 0 with its current value."""
    if rows.shape[0] == 0:
        return
    valid = slot_mapping >= 0
    first_valid = valid.to(torch.int32).argmax()  # the first maximum: 0 where no row is valid
    source = torch.where(valid, torch.arange(rows.shape[0], device=rows.device), first_valid)
    target = slot_mapping[source].clamp(min=0).to(torch.int64)
    keep = valid[source].view(-1, *([1] * (rows.dim() - 1)))
    flat.index_copy_(0, target, torch.where(keep, rows[source], flat.index_select(0, target)))


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
    """One query row per sequence at position seq_lens[b] - 1; see the Triton kernel's contract.
    `num_splits` only shapes the kernel's work and is ignored here."""
    del num_splits
    query_positions = (seq_lens - 1).unsqueeze(1)  # [B, 1]
    result = _paged_attention(
        q.unsqueeze(1), key_cache, value_cache, block_tables, seq_lens, query_positions,
        scale, sliding_window, k_scales, v_scales, sinks,
    ).squeeze(1)
    return _into(out, result)


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
    """Causal attention of flattened query rows (sequence i owns rows query_start_loc[i]:[i+1], its
    newest tokens) over the whole cache; see the Triton kernel's contract."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return _into(out, torch.empty_like(q))
    # Pad the rows to [B, max_query_len]: each sequence's rows, then gathered back in order.
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    query_lens = ends - starts
    offsets = torch.arange(max_query_len, device=q.device)
    rows = (starts.unsqueeze(1) + offsets).clamp(max=num_tokens - 1)  # [B, max_query_len]
    query_positions = (seq_lens - query_lens).unsqueeze(1) + offsets
    query_positions = torch.where(offsets < query_lens.unsqueeze(1), query_positions, -1)  # -1 sees nothing
    padded = _paged_attention(
        q[rows], key_cache, value_cache, block_tables, seq_lens, query_positions,
        scale, sliding_window, k_scales, v_scales, sinks,
    )
    tokens = torch.arange(num_tokens, device=q.device, dtype=ends.dtype)
    seq_of_token = torch.searchsorted(ends, tokens, right=True).clamp(max=seq_lens.shape[0] - 1)
    result = padded[seq_of_token, tokens - starts[seq_of_token]]
    return _into(out, result)


def _paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_positions, scale,
                     sliding_window, k_scales, v_scales, sinks=None):
    """q [B, M, num_heads, head_dim], query_positions [B, M] (negative: the row sees no key) ->
    [B, M, num_heads, head_dim] in q's dtype, computed in float32 (float64 for float64 inputs).
    `sinks` [num_heads] (gpt-oss): a logit per head in every row's softmax denominator."""
    batch, rows, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    if key_cache.is_floating_point():
        compute = torch.promote_types(compute, key_cache.dtype)
    keys = _gather(key_cache, k_scales, block_tables, compute)  # [B, N, num_kv_heads, head_dim]
    values = _gather(value_cache, v_scales, block_tables, compute)
    key_positions = torch.arange(keys.shape[1], device=q.device)
    # Slots past a sequence's end may hold anything (a cache from torch.empty, NaN included), and a
    # zero weight times NaN is NaN: zero them. (Masked scores are overwritten below.)
    values = values.masked_fill((key_positions >= seq_lens.unsqueeze(1))[:, :, None, None], 0.0)
    queries = q.to(compute).view(batch, rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("bmkgd,bnkd->bkgmn", queries, keys) * scale

    qp = query_positions[:, None, None, :, None]  # [B, 1, 1, M, 1]
    allowed = (key_positions <= qp) & (key_positions < seq_lens[:, None, None, None, None])
    if sliding_window > 0:
        allowed &= key_positions > qp - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    # A row that sees no key (seq_len 0, a padding row) gets zeros, not the NaN softmax would give.
    row_max = scores.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(compute).view(1, num_kv_heads, group, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - row_max)
    total = weights.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - row_max)
    weights = weights / torch.where(total > 0, total, 1.0)
    result = torch.einsum("bkgmn,bnkd->bmkgd", weights, values)
    return result.reshape(batch, rows, num_heads, head_dim).to(q.dtype)


def _gather(cache, scales, block_tables, dtype):
    """Every sequence's blocks in order: [B, max_blocks * block_size, num_kv_heads, head_dim]."""
    batch, max_blocks = block_tables.shape
    num_blocks, block_size, heads, dim = cache.shape
    # Entries past a row's last block may be stale (a CUDA-graph step sends only the columns its
    # rows use): the kernels never read them; here every column is gathered, then masked, so any
    # entry must at least index a block.
    block_tables = block_tables.clamp(0, num_blocks - 1)
    rows = cache[block_tables].to(dtype)
    if scales is not None:
        rows = rows * scales[block_tables].to(dtype).unsqueeze(-1)
    return rows.reshape(batch, max_blocks * block_size, heads, dim)  # a column-major table gathers column-major


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
