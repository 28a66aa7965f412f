"""Rotary position embedding applied to queries or keys, in torch: the reference of the fused
rotary kernels (`kernels/cuda/rotary_kv.py`) and the models' own path."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in the half-split (NeoX) layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
