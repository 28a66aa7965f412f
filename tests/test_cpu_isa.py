"""The AVX2 build of the CPU kernels on a CPU that also has AVX-512 VNNI: the suite otherwise runs
only the best build this CPU takes, so the path of AVX2-only machines (GGUF blocks in the file's
layout, no packing) is checked here, in a child process built with `CADENZA_CPU_ISA=avx2`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cadenza.kernels import cpu
from cadenza.models.cpu_features import cpu_has_avx2_fma, cpu_has_avx512_vnni

CHILD = textwrap.dedent(
    """
    import gguf, numpy as np, torch
    from cadenza.kernels import cpu
    from cadenza.models.quantized_linear import pack_for_kernels

    assert cpu.isa() == "avx2"
    kernels = cpu.configure("on")
    assert not kernels.packed_kernels_built()
    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        blocks = gguf.quants.quantize(rng.standard_normal((48, 96)).astype(np.float32), qtype)
        w = torch.from_numpy(blocks)
        same, kept = pack_for_kernels(kernels, w, int(qtype))
        assert same is w and kept == int(qtype)  # nothing packed without AVX-512 VNNI
        x = torch.randn(3, 96)
        ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64)).T
        got = kernels.quant_linear(x, w, int(qtype), None).double()
        # int8 activations: within a few hundredths of the float64 product's scale.
        assert (got - ref).abs().max() < 0.02 * ref.abs().max(), (got - ref).abs().max()
        try:
            kernels.quant_linear(x, w, int(qtype) + 256, None)
        except RuntimeError as exc:
            assert "AVX-512 VNNI" in str(exc)
        else:
            raise AssertionError("a packed type ran on the AVX2 build")
    print("avx2 build ok")
    """
)


@pytest.mark.skipif(not cpu_has_avx2_fma() or not cpu_has_avx512_vnni(), reason="this CPU builds only one variant")
def test_the_avx2_build_runs_the_file_layout():
    if cpu.configure("auto") is None:
        pytest.skip(f"the CPU kernels do not build here: {cpu.build_error()}")
    env = {**os.environ, cpu.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "avx2 build ok" in done.stdout


def test_an_isa_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx512vnni")
    if cpu_has_avx512_vnni():
        assert cpu.isa() == "avx512vnni"
    else:
        with pytest.raises(ValueError, match="lacks"):
            cpu.isa()
    monkeypatch.setenv(cpu.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="must be one of"):
        cpu.isa()
