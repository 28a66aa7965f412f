"""A one-pass Triton sampler: each row's token from its logits in one read, greedy or at a temperature.

The torch path (samplers/pipeline.py and default_sampler.py) copies the logits to float32, divides
by the temperature, takes a softmax, draws V noise values, divides and takes the argmax: about ten
passes over [B, V]. Here one program per row streams its logits once, in their own dtype, and keeps
the running best of `logit / T + Gumbel noise` (Gumbel-max: token i wins with probability
softmax(logit / T)[i], the exponential race's distribution), or of the logit itself where T is 0
(greedy: the first index of the maximum, as torch's argmax). The noise is a counter-based hash of
(row key, token id), the key set per row by the host: a seeded request's key mixes its seed with its position in the output, so its
tokens depend on its seed alone, whatever else shares the batch; unseeded rows are keyed from one
draw a step. Shapes alone set the grid: the launch can be captured with the LM head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton.paged_attention import _max

_GOLDEN = 0x9E3779B97F4A7C15  # odd: key = seed * it + position is a bijection of the position for a seed
_KEY_MASK = (1 << 63) - 1


def row_key(seed: int, position: int) -> int:
    """The noise key of a row (`_uniform`): its seed mixed with its position in the output (non-negative int64)."""
    return (seed * _GOLDEN + position) & _KEY_MASK


@triton.jit
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _fmix32(x):
    """MurmurHash3's finalizer: every input bit flips each output bit with probability about 1/2."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, cols):
    """A uniform draw in (0, 1) for each column, a hash of (key, column): counter-based, so a row's
    noise needs no state. (tl.rand's Philox is a function triton.language defines with @triton.jit,
    interpreted only where TRITON_INTERPRET was on at import; see paged_attention.py.)"""
    low = (key & 0xFFFFFFFF).to(tl.uint32)
    high = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    x = _fmix32(cols.to(tl.uint32) * 0x9E3779B9 + low)
    x = _fmix32(x ^ high)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0) + (0.5 / 16777216.0)  # 24 bits, never 0 or 1


@triton.jit
def _sample_kernel(logits_ptr, stride, temperatures_ptr, keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    key = tl.load(keys_ptr + row)
    sampled = temperature > 0.0
    inverse = 1.0 / tl.where(sampled, temperature, 1.0)
    best = tl.full([], -float("inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=inside, other=-float("inf")).to(tl.float32)
        score = tl.where(sampled, x * inverse - tl.log(-tl.log(_uniform(key, cols))), x)  # + Gumbel noise
        score = tl.where(inside, score, -float("inf"))
        top = _max(score, 0)
        index = _min(tl.where(score == top, cols, vocab), 0)
        better = top > best
        best_index = tl.where(better, index, best_index)
        best = tl.where(better, top, best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token id per row of `logits` [B, V] (any float dtype, rows contiguous): greedy where
    `temperatures` [B] (float32) is 0, else drawn from softmax(logits / T) with the noise
    of `keys` [B] (int64, `row_key`). int64 [B] on the logits' device."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample needs logits whose rows are contiguous")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(4096, triton.next_power_of_2(vocab))
        _sample_kernel[(rows,)](logits, logits.stride(0), temperatures, keys, out, vocab, BLOCK=block, num_warps=8)
    return out
