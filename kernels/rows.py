"""Per-row values as a column on the logits' device, for the batched sampling ops."""

from __future__ import annotations

import torch


def row_column(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    """One value per row, shaped [B, 1] to broadcast over the vocabulary.

    On a GPU the values go through pinned host memory and are copied without blocking: a copy from
    pageable memory makes the host wait for the copy at every step (several of these a sampled
    step). torch's caching host allocator keeps the pinned buffer until the copy has run."""
    if logits.device.type == "cuda":
        host = torch.tensor(values, dtype=logits.dtype, pin_memory=True)
        return host.to(logits.device, non_blocking=True).unsqueeze(1)
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)
