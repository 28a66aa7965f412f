"""A prefill over quantized weights through de-quantized GEMMs.

On a CPU that multiplies bfloat16 natively, the MLP's gate/up product stays bfloat16 into
`silu_mul_bf16` and the down projection, and the layer's output is bit for bit the float32
route's (which rounded the same values at the same places). A weight larger than the scratch
(`GEMM_SLICE_VALUES`) is de-quantized and multiplied a slice of output rows at a time, and gives
what the whole weight gives."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_quantized import random_blocks

from cadenza.kernels.cpu import loader as cpu
from cadenza.kernels.cpu.features import cpu_has_avx2_fma
from cadenza.models import quantized_linear
from cadenza.models.llama import MLP
from cadenza.models.quantized_linear import QuantizedLinear, QuantizedTensor

pytestmark = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="the CPU kernels need x86-64 with AVX2 and FMA")

HIDDEN, INTERMEDIATE = 256, 512


def _quantized(rows: int, cols: int, rng) -> QuantizedLinear:
    linear = QuantizedLinear(cols, rows, bias=False)
    linear.load_rows(0, QuantizedTensor(torch.from_numpy(random_blocks(Q.Q4_K, rows, cols, rng)), int(Q.Q4_K), cols))
    linear.finish_loading()
    return linear


def _mlp(kernels) -> MLP:
    rng = np.random.default_rng(0)
    mlp = MLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, mlp_bias=False, residual_multiplier=1.0,
                              hidden_act="silu", swiglu_alpha=1.702, swiglu_limit=7.0))  # what MLP reads
    mlp.gate_up_proj, mlp.down_proj = _quantized(2 * INTERMEDIATE, HIDDEN, rng), _quantized(HIDDEN, INTERMEDIATE, rng)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.use_cpu_kernels(kernels)
        linear.gemm_dtype, linear.min_rows = torch.bfloat16, 16  # as on a CPU with AMX, whatever this one has
    mlp.use_cpu_kernels(kernels)
    return mlp


@pytest.mark.parametrize("rows", [4, 40])  # the int8 kernel (no bfloat16 route); the bfloat16 GEMMs
def test_the_bf16_route_gives_the_float32_routes_bits(rows):
    kernels = cpu.configure("on")
    mlp = _mlp(kernels)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    residual = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows + 1))
    assert (mlp._bf16_gate_up(x) is not None) == (rows == 40)
    with torch.no_grad():
        got = mlp(x, residual.clone())
        # The float32 route: the GEMM's bfloat16 output widened, SiLU * up in float32, the down
        # projection rounding its input to bfloat16 again.
        hidden = kernels.silu_mul(mlp.gate_up_proj(x))
        want = mlp.down_proj.linear_add_(residual.clone(), hidden)
    assert torch.equal(got, want)
    assert not torch.equal(got, residual)


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_a_weight_over_the_scratch_runs_a_slice_of_rows_at_a_time(gemm_dtype, monkeypatch):
    """Three parts (Q4_K, Q6_K, Q4_K) of 160 + 96 + 64 rows, a scratch of 64 rows: slices within
    each part, each into its own columns; the product, the fused add and the bfloat16 product
    equal the whole weight's."""
    kernels = cpu.configure("on")
    rng = np.random.default_rng(1)
    linear = QuantizedLinear(HIDDEN, 320, bias=False)
    first = 0
    for qtype, rows in ((Q.Q4_K, 160), (Q.Q6_K, 96), (Q.Q4_K, 64)):
        linear.load_rows(first, QuantizedTensor(torch.from_numpy(random_blocks(qtype, rows, HIDDEN, rng)), int(qtype), HIDDEN))
        first += rows
    linear.finish_loading()
    linear.use_cpu_kernels(kernels)
    linear.gemm_dtype, linear.min_rows = gemm_dtype, 16
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(5))
    residual = torch.randn(24, 320, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = [len(list(linear._dequantized_slices())), linear(x), linear.linear_add_(residual.clone(), x),
                 linear.bf16_product(x)]
        monkeypatch.setattr(quantized_linear, "GEMM_SLICE_VALUES", 64 * HIDDEN)
        sliced = [[(a, b) for a, b, _ in linear._dequantized_slices()], linear(x), linear.linear_add_(residual.clone(), x),
                  linear.bf16_product(x)]
    assert whole[0] == 1 and sliced[0] == [(0, 64), (64, 128), (128, 160), (160, 224), (224, 256), (256, 320)]
    for got, want in zip(sliced[1:3], whole[1:3]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if gemm_dtype == torch.bfloat16:
        assert sliced[3].dtype == torch.bfloat16
        torch.testing.assert_close(sliced[3], whole[3], rtol=1e-2, atol=1e-2)
    else:
        assert sliced[3] is None and whole[3] is None
