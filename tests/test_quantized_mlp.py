"""A prefill's MLP over quantized weights on a CPU that multiplies bfloat16 natively: the
gate/up product stays bfloat16 into `silu_mul_bf16` and the down projection, and the layer's
output is bit for bit the float32 route's (which rounded the same values at the same places)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_quantized import random_blocks

from cadenza.kernels.cpu import loader as cpu
from cadenza.kernels.cpu.features import cpu_has_avx2_fma
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
    mlp = MLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, mlp_bias=False))  # what MLP reads
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
