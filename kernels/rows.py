"""Per-row values as a column on the logits' device, for the batched sampling ops."""

from __future__ import annotations

import torch


def row_column(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    """One value per row, shaped [B, 1] to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)
