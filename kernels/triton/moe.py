"""A mixture of experts' products on the GPU as grouped GEMMs: every (token, expert) pair of a step
in one launch per projection, whatever the number of experts picked.

The pairs are sorted by expert and each expert's run padded to a whole tile of BLOCK_M rows
(`align_by_expert`), so a program multiplies BLOCK_M rows that all use one expert's weight. Every
shape is bounded by the step's size alone (T * top_k pairs plus at most BLOCK_M - 1 of padding an
expert), nothing is read back to the host, and padding rows carry an out-of-range pair id that the
kernel masks: a step can be captured in a CUDA graph. The idea is vLLM's and SGLang's fused MoE
(moe_align_block_size); the code is cadenza's.

`grouped_expert_matmul` computes, for each pair p of expert e(p), a's row of p times e(p)'s weight
(plus its bias, times p's routing weight where given); a's rows are tokens for the first projection
(each token's row read by its k pairs) or pairs for the second (each pair's own hidden row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class ExpertAlignment(NamedTuple):
    """The step's (token, expert) pairs grouped by expert, in tiles of `block_m` rows."""

    sorted_pairs: torch.Tensor  # [padded] int32: pair id (token * top_k + slot), or num_pairs for padding
    tile_experts: torch.Tensor  # [padded / block_m] int32: the expert of each tile (-1: past the end)
    block_m: int


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the pairs of `expert_ids` [T, top_k] by expert, each expert's run padded to a multiple
    of `block_m`, pairs of one expert in token order. Sync-free: every shape comes from T, top_k,
    num_experts and block_m."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    padded_len = num_pairs + num_experts * (block_m - 1)
    padded_len = -(-padded_len // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded_counts, 0)
    run_starts = run_ends - padded_counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in `order`
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((padded_len,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[run_starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, padded_len, block_m, device=flat.device)
    tile_experts = torch.searchsorted(run_ends, tile_starts, right=True).to(torch.int32)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return ExpertAlignment(sorted_pairs, tile_experts, block_m)


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, weights_ptr,
    num_pairs, N, K, a_rows_per_pair,
    stride_am, stride_we, stride_wn, stride_be, stride_om,
    HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (tiles, N tiles): BLOCK_M pairs of one expert times BLOCK_N of its output rows."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    a_rows = (pairs // a_rows_per_pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc *= tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    out_rows = pairs.to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pair_mask[:, None] & col_mask[None, :])


def grouped_expert_matmul(a: torch.Tensor, weight: torch.Tensor, alignment: ExpertAlignment, num_pairs: int,
                          a_rows_per_pair: int, bias: torch.Tensor | None = None,
                          pair_weights: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [num_pairs, N]: row p = a[p // a_rows_per_pair] @ weight[e(p)]^T (+ bias[e(p)]) (* pair_weights[p]).

    a: [rows, K] (tokens, with a_rows_per_pair = top_k; or pairs, with 1), unit stride in K.
    weight: [experts, N, K] (each expert's [out, in], as the checkpoint's linears), unit stride in K.
    bias: [experts, N] or None. pair_weights: [num_pairs] float32 (the routing weights, flattened
    [T, top_k]) or None. Accumulates in float32; out takes a's dtype."""
    experts, n, k = weight.shape
    if a.shape[1] != k or weight.stride(2) != 1 or a.stride(1) != 1:
        raise ValueError(f"a {tuple(a.shape)} and weight {tuple(weight.shape)} need matching K of unit stride")
    if out is None:
        out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    tiles = alignment.tile_experts.shape[0]
    _grouped_kernel[(tiles, triton.cdiv(n, block_n))](
        a, weight, bias if bias is not None else weight, out, alignment.sorted_pairs, alignment.tile_experts,
        pair_weights if pair_weights is not None else weight,
        num_pairs, n, k, a_rows_per_pair,
        a.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, WEIGHTED=pair_weights is not None,
        BLOCK_M=alignment.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
