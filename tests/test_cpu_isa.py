"""The AVX2 build of the CPU kernels on a CPU that also has AVX-512 VNNI: the suite otherwise runs
only the best build this CPU takes, so the path of AVX2-only machines (GGUF blocks in the file's
layout, no packing) is checked here, in a child process that acts as an AVX2 CPU (`CADENZA_CPU=avx2`).
`.ci/run` also runs the CPU-sensitive suites as each kind of CPU this machine can stand in for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cadenza import environment
from cadenza.kernels import cpu
from cadenza.models import cpu_features
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
    env = {**os.environ, environment.CPU.name: "avx2"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "avx2 build ok" in done.stdout


def test_a_kind_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.delenv(environment.CPU_ISA.name, raising=False)
    monkeypatch.setenv(environment.CPU.name, "avx512-vnni")
    if cpu_features.AVX512_VNNI_FLAGS <= cpu_features.native_cpu_flags():
        assert cpu.isa() == "avx512vnni"
    else:
        with pytest.raises(ValueError, match="lacks"):
            cpu.isa()
    monkeypatch.setenv(environment.CPU.name, "sse2")
    with pytest.raises(ValueError, match="must be one of native, avx2"):
        cpu.isa()


def test_each_kind_hides_what_it_lacks(monkeypatch):
    monkeypatch.delenv(environment.CPU_ISA.name, raising=False)
    native = cpu_features.native_cpu_flags()
    for kind, features in cpu_features.CPU_KINDS.items():
        monkeypatch.setenv(environment.CPU.name, kind)
        if not features <= native:
            with pytest.raises(ValueError, match=f"{environment.CPU.name}={kind} but this CPU lacks"):
                cpu_features.cpu_flags()
            continue
        flags = cpu_features.cpu_flags()
        assert features <= flags <= native
        assert cpu_features.cpu_has_native_bf16() == ("avx512_bf16" in features)
        assert cpu_features.cpu_has_avx512_vnni() == (cpu_features.AVX512_VNNI_FLAGS <= features)
        assert cpu_features.cpu_has_avx_vnni() == ("avx_vnni" in features)
        assert cpu.isa() == ("avx512vnni" if cpu_features.AVX512_VNNI_FLAGS <= features else "avx2")
    monkeypatch.setenv(environment.CPU.name, "native")
    assert cpu_features.cpu_flags() == native


def test_the_older_variable_still_names_a_kind(monkeypatch):
    monkeypatch.delenv(environment.CPU.name, raising=False)
    monkeypatch.setenv(environment.CPU_ISA.name, "avx2")
    assert cpu_features.cpu_kind() == "avx2" and cpu.isa() == "avx2"


def test_the_kind_holds_pytorch_to_it_too(monkeypatch):
    monkeypatch.delenv(environment.CPU_ISA.name, raising=False)
    monkeypatch.setenv(environment.CPU.name, "avx2")
    environ: dict[str, str] = {}
    cpu_features.apply_cpu_kind_to_torch(environ)
    assert environ == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    environ = {"ATEN_CPU_CAPABILITY": "default"}  # a value set by hand wins
    cpu_features.apply_cpu_kind_to_torch(environ)
    assert environ["ATEN_CPU_CAPABILITY"] == "default"
    monkeypatch.setenv(environment.CPU.name, "native")
    environ = {}
    cpu_features.apply_cpu_kind_to_torch(environ)
    assert environ == {}


def test_a_child_acting_as_avx2_sees_pytorch_at_avx2():
    if not cpu_has_avx2_fma():
        pytest.skip("not an AVX2 CPU")
    env = {**os.environ, environment.CPU.name: "avx2"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    code = "import cadenza, torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "AVX2"
