"""Linear layers for CPUs without native bfloat16: bf16 weights for matrix-vector products,
an exact float32 copy for matrix-matrix products, float32 activations in and out.

Decoding a few sequences is memory-bound: reading half the bytes (bf16) wins. Prefill and large
decode batches are compute-bound, and without AVX512-BF16/AMX PyTorch's bf16 GEMM is 3-7x slower
than float32 on the same shapes, so those multiply the float32 copy (the exact upcast of the same
bf16 values; accumulation is float32 either way). Activations stay float32 between layers, so no
per-layer conversion of activations or of the KV cache is needed.

With cadenza's CPU kernels (`cadenza.kernels.cpu.loader`), matrix-vector products multiply the bf16
weights by the float32 activations directly (no rounding of the activations to bf16, no extra
casts), reading the weights at close to the memory bandwidth, and `linear_add_` fuses the
residual add into the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows at or above which the float32 copy wins (measured on AVX2: bf16 is already ~2.5x slower at 8).
FP32_MIN_ROWS = 4
# The same with the CPU kernel, which reads each bf16 weight once from memory whatever the rows and
# beats PyTorch's float32 GEMM up to ~100 rows on AVX2 (benchmarks/NOTES.md, "bf16 kernel").
KERNEL_FP32_MIN_ROWS = 128


class DualPrecisionLinear(nn.Module):
    def __init__(self, linear: nn.Linear, min_rows: int = FP32_MIN_ROWS) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_f32", linear.weight.detach().float(), persistent=False)
        self.register_buffer(
            "bias_f32", None if linear.bias is None else linear.bias.detach().float(), persistent=False
        )
        self.base_min_rows = min_rows  # without the kernel
        self.min_rows = min_rows
        self.kernels = None  # cadenza.kernels.cpu.loader's module, when switched on (see `use_cpu_kernels`)

    def use_cpu_kernels(self, kernels) -> None:
        """Multiply bf16 weights by the kernel (None: by PyTorch); the float32 copy then serves
        only from `KERNEL_FP32_MIN_ROWS` rows on."""
        self.kernels = kernels if self.weight.dtype == torch.bfloat16 else None
        self.min_rows = KERNEL_FP32_MIN_ROWS if self.kernels is not None else self.base_min_rows

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return F.linear(x.float(), self.weight_f32, self.bias_f32)
        if self._kernel_applies(x):
            return self.kernels.linear_bf16(x, self.weight, self.bias_f32)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()

    def linear_add_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual += self(x)`, in place, fused into the product where the kernel runs."""
        if x.shape[0] < self.min_rows and self._kernel_applies(x) and residual.dtype == torch.float32:
            return self.kernels.linear_bf16_add_(residual, x, self.weight, self.bias_f32)
        return residual.add_(self(x))


def linear_add_(linear: nn.Module, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`residual += linear(x)` in place, for any linear layer (fused into the product for those
    that offer `linear_add_`: `DualPrecisionLinear`, `QuantizedLinear`)."""
    if hasattr(linear, "linear_add_"):
        return linear.linear_add_(residual, x)
    return residual.add_(linear(x))


def use_dual_precision(model: nn.Module, min_rows: int = FP32_MIN_ROWS) -> int:
    """Swap every bf16/fp16 `nn.Linear` of `model` for a `DualPrecisionLinear`; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype in (torch.bfloat16, torch.float16):
                setattr(parent, name, DualPrecisionLinear(child, min_rows))
                swapped += 1
    return swapped
