"""The build variants of the CPU kernels on a CPU that can stand in for several kinds: the suite
otherwise runs only the build this CPU takes, so each other variant (`avx2`: 8-row packed products on
vpmaddubsw; `avx2-vnni`: the same on AVX-VNNI's vpdpbusd) is checked here, in a child process that acts
as that kind (`CADENZA_CPU`): the variant chosen, the one log line naming it, and a packed product
against the float64 reference. `.ci/run` also runs the CPU-sensitive suites as each kind of CPU this
machine can stand in for (tests/run_as_cpu_kinds.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cadenza.config import environment
from cadenza.kernels.cpu import features as cpu_features
from cadenza.kernels.cpu import loader as cpu
from cadenza.kernels.cpu.features import cpu_has_avx2_fma

CHILD = textwrap.dedent(
    """
    import sys
    import gguf, numpy as np, torch
    from cadenza.kernels.cpu import loader as cpu
    from cadenza.models.quantized_linear import pack_for_kernels

    isa, path, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert cpu.isa() == isa, cpu.isa()
    kernels = cpu.configure("on")
    assert cpu.path() == kernels.packed_path() == path and kernels.pack_rows() == rows
    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        blocks = gguf.quants.quantize(rng.standard_normal((48, 96)).astype(np.float32), qtype)
        w = torch.from_numpy(blocks)
        packed, packed_type = pack_for_kernels(kernels, w, int(qtype))
        assert packed_type == int(qtype) + 256 and not torch.equal(packed, w)
        x = torch.randn(3, 96)
        ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64)).T
        for weight, type_id in ((w, int(qtype)), (packed, packed_type)):
            got = kernels.quant_linear(x, weight, type_id, None).double()
            # int8 activations: within a few hundredths of the float64 product's scale.
            assert (got - ref).abs().max() < 0.02 * ref.abs().max(), (got - ref).abs().max()
    print("variant ok")
    """
)

# kind -> (variant, products, rows a packed group)
VARIANTS = {
    "avx2": ("avx2", "avx2-packed8", 8),
    "avx2-vnni": ("avx2vnni", "avxvnni-packed8", 8),
    "avx512-vnni": ("avx512vnni", "avx512vnni-packed16", 16),
}


@pytest.mark.parametrize("kind", ["avx2", "avx2-vnni"])
def test_each_build_variant_runs_its_packed_products_and_says_so(kind):
    if not cpu_has_avx2_fma() or not cpu_features.CPU_KINDS[kind] <= cpu_features.native_cpu_flags():
        pytest.skip(f"this CPU cannot act as {kind}")
    if cpu.configure("auto") is None:
        pytest.skip(f"the CPU kernels do not build here: {cpu.build_error()}")
    env = {**os.environ, environment.CPU.name: kind}
    for name in cpu_features.TORCH_KIND_VARS:
        env.pop(name, None)
    isa, path, rows = VARIANTS[kind]
    done = subprocess.run([sys.executable, "-c", CHILD, isa, path, str(rows)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "variant ok" in done.stdout
    ready = [line for line in (done.stdout + done.stderr).splitlines() if "CPU kernels ready" in line]
    assert len(ready) == 1 and f"path={path}" in ready[0] and f"isa={isa}" in ready[0], ready


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
        assert cpu.isa() == VARIANTS.get(kind, VARIANTS["avx512-vnni"])[0]  # every AVX-512 kind: the zmm build
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
    inductor_cache = environ.pop(cpu_features.INDUCTOR_CACHE_VAR)
    assert environ == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    # Inductor compiles into a cache of the kind's own: a native build loaded back as avx2 gave NaN.
    assert inductor_cache.endswith("_cadenza-avx2")
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
