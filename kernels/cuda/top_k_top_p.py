"""Top-k then top-p masking of a batch's logits in one cupy kernel (top_k_top_p.cu), else torch.

samplers/logits_processors.py's `TopKTopPProcessor` calls `top_k_top_p` for CUDA logits. The
kernel sorts nothing: one block a row finds the k-th largest logit, then the nucleus' smallest,
by radix select over the floats' bits (a few histogram passes over the row), and masks below it.
The torch fallback is the processor's own implementation (kernels/top_k_top_p.py).

CUDA graphs: `top_k_top_p_cuda` (parameters already on the device) is one launch on torch's
current stream with no host sync, so it can be captured once compiled. `top_k_top_p` copies its
Python lists to the device every call: not for capture.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from cadenza.kernels.cuda import loader
from cadenza.kernels.top_k_top_p import mask_top_k_top_p

SOURCE = "top_k_top_p.cu"
KERNEL = "top_k_top_p_f32"
# Threads a row: its 2 KiB of shared histograms stay small, so several rows share an SM.
THREADS = 512


def top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Mask `logits` [B, V] in place (and return them), row i by `top_k[i]` and `top_p[i]`.

    Row i keeps its `top_k[i]` largest logits (1 <= k <= V; V is off; every logit tied with the
    k-th survives), then, of those, the smallest set of the most likely whose probability
    (renormalized after top-k) reaches `top_p[i]` (0 < p <= 1; 1 is off); the rest become -inf.
    The row's largest logit always survives. These are `TopKTopPProcessor`'s semantics, and its
    lists (`_row_params`) are what this takes.

    The kernel runs for float32 CUDA logits where cupy's kernels are available (kernels/cuda/loader.py),
    else `mask_top_k_top_p` (the processor's torch path). The two agree except at the nucleus' edge: the kernel keeps
    logits tied there together, and its float sums round otherwise than torch's sort and cumsum,
    so a logit whose preceding mass equals top_p within rounding may go either way.
    """
    vocab = logits.shape[-1]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    kernels = _kernels(logits)
    if kernels is None:
        return mask_top_k_top_p(logits, list(top_k), list(top_p))
    ks = torch.tensor(list(top_k), dtype=torch.int32, device=logits.device)
    ps = torch.tensor(list(top_p), dtype=torch.float32, device=logits.device)
    _launch(kernels, logits, ks, ps)
    return logits


def top_k_top_p_cuda(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`top_k_top_p` by the kernel alone, its parameters already on the logits' device: `top_k`
    int32 [B] (k <= 0 or k >= V: off), `top_p` float32 [B] (p >= 1: off). Safe in CUDA-graph
    capture after a first call. Raises RuntimeError where the kernel cannot run these logits."""
    kernels = _kernels(logits)
    if kernels is None:
        why = loader.kernel_error(SOURCE) or "needs float32 CUDA logits [B, V] with a contiguous vocabulary"
        raise RuntimeError(f"the top-k/top-p kernel cannot run here: {why}")
    shaped = top_k.shape == top_p.shape == logits.shape[:1] and top_k.device == top_p.device == logits.device
    if top_k.dtype != torch.int32 or top_p.dtype != torch.float32 or not shaped:
        raise ValueError("top_k must be int32 [B] and top_p float32 [B] on the logits' device, B their rows")
    _launch(kernels, logits, top_k.contiguous(), top_p.contiguous())
    return logits


def _kernels(logits: torch.Tensor) -> dict | None:
    usable = (
        logits.is_cuda
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] > 0
        and logits.stride(-1) == 1
        and logits.shape[1] < 2**31
    )
    return loader.kernels_for(SOURCE, (KERNEL,), logits.device) if usable else None


def _launch(kernels: dict, logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> None:
    # Grid: one block a row; each block strides over its row (see top_k_top_p.cu).
    args = (
        loader.as_cupy(logits),
        np.int64(logits.stride(0)),
        np.int32(logits.shape[1]),
        loader.as_cupy(ks),
        loader.as_cupy(ps),
    )
    loader.launch(kernels[KERNEL], (logits.shape[0],), (THREADS,), args, logits.device)
