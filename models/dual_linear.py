"""Linear layers for CPUs without native bfloat16: bf16 weights for matrix-vector products,
an exact float32 copy for matrix-matrix products, float32 activations in and out.

Decoding a few sequences is memory-bound: reading half the bytes (bf16) wins. Prefill and large
decode batches are compute-bound, and without AVX512-BF16/AMX PyTorch's bf16 GEMM is 3-7x slower
than float32 on the same shapes, so those multiply the float32 copy (the exact upcast of the same
bf16 values; accumulation is float32 either way). Activations stay float32 between layers, so no
per-layer conversion of activations or of the KV cache is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows at or above which the float32 copy wins (measured on AVX2: bf16 is already ~2.5x slower at 8).
FP32_MIN_ROWS = 4


class DualPrecisionLinear(nn.Module):
    def __init__(self, linear: nn.Linear, min_rows: int = FP32_MIN_ROWS) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_f32", linear.weight.detach().float(), persistent=False)
        self.register_buffer(
            "bias_f32", None if linear.bias is None else linear.bias.detach().float(), persistent=False
        )
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return F.linear(x.float(), self.weight_f32, self.bias_f32)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()


def use_dual_precision(model: nn.Module, min_rows: int = FP32_MIN_ROWS) -> int:
    """Swap every bf16/fp16 `nn.Linear` of `model` for a `DualPrecisionLinear`; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype in (torch.bfloat16, torch.float16):
                setattr(parent, name, DualPrecisionLinear(child, min_rows))
                swapped += 1
    return swapped
