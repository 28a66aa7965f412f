"""Top-k then top-p masking of a batch's logits in torch, on any device: the `top_k_top_p`
processor's implementation (samplers/logits_processors.py), and what kernels/cuda's fused kernel falls
back to where it cannot run. A module of its own so that neither of those imports the other."""

from __future__ import annotations

import torch

from cadenza.kernels.rows import row_column

NEG_INF = float("-inf")


def mask_top_k_top_p(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Row i of `logits` keeps its `ks[i]` largest (V: off), then the nucleus reaching `ps[i]`
    (1: off); the rest become -inf, in place."""
    vocab = logits.shape[-1]
    if all(p >= 1.0 for p in ps):
        if all(k >= vocab for k in ks):
            return logits
        return _top_k_only(logits, ks)

    # Ascending sort, as HF and vLLM do: the kept tokens are those whose ascending cumulative
    # probability exceeds 1 - top_p, which is exactly "the smallest set reaching top_p".
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if any(k < vocab for k in ks):
        # The k-th largest logit sits at ascending position V - k.
        kth_pos = torch.tensor([vocab - k for k in ks], device=logits.device).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_pos)
        sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1.0 - row_column(ps, logits)
    drop[:, -1] = False  # the top token always survives, whatever rounding did to the sum
    # Rows with top_p == 1 compare against 0: they only re-mask tokens already at zero mass.
    sorted_logits.masked_fill_(drop, NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _top_k_only(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    max_k = max(k for k in ks if k < logits.shape[-1])
    top = logits.topk(max_k, dim=-1).values
    # Rows without top-k compare against -inf, which masks nothing.
    pos = torch.tensor([min(k, max_k) - 1 for k in ks], device=logits.device).unsqueeze(1)
    kth = top.gather(1, pos)
    kth[torch.tensor([k >= logits.shape[-1] for k in ks], device=logits.device)] = NEG_INF
    return logits.masked_fill_(logits < kth, NEG_INF)
