"""What the CPU can do, for choosing kernels: the one place cadenza reads the CPU's features.

`CADENZA_CPU` (environment.CPU) makes cadenza act as another kind of x86-64 CPU that this one can
stand in for: `avx2` (an AMD EPYC before Zen 4: no AVX-512, no native bf16), `avx2-vnni` (Alder
Lake and later: AVX2 with 256-bit VNNI), `avx512-vnni` (Ice Lake, Cascade Lake), `avx512-bf16`
(Zen 4), `amx` (Sapphire Rapids and later), or `native` (the default: this CPU as it is). Every
decision that reads the CPU goes through `cpu_flags()`: the kernel build and its packed layouts,
`cpu_fp32_matmul: auto`, the attention's compute dtype and the KV cache's. So one machine can run
the suite as each kind it can execute, and a kind whose features this CPU lacks is refused.
`apply_cpu_kind_to_torch()` holds PyTorch's own kernels (ATen's vector code, oneDNN and MKL) to the
same kind, where it runs before torch is imported.
"""

from __future__ import annotations

import functools
import getpass
import os
import platform
import tempfile
from pathlib import Path

from cadenza.config import environment

AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AMX_FLAGS = frozenset({"amx_bf16", "amx_int8", "amx_tile"})

# kind -> the features it has beyond plain x86-64 (of those a kind can lack: see _kind_gated).
CPU_KINDS: dict[str, frozenset[str]] = {
    "avx2": AVX2_FLAGS,
    "avx2-vnni": AVX2_FLAGS | {"avx_vnni"},
    "avx512-vnni": AVX2_FLAGS | AVX512_VNNI_FLAGS,
    "avx512-bf16": AVX2_FLAGS | AVX512_VNNI_FLAGS | {"avx512_bf16"},
    "amx": AVX2_FLAGS | AVX512_VNNI_FLAGS | {"avx512_bf16"} | AMX_FLAGS,
}
NATIVE = "native"
_LEGACY_NAMES = {"avx512vnni": "avx512-vnni"}  # CADENZA_CPU_ISA's values

# What PyTorch is told for each kind: ATen's vector code (ATEN_CPU_CAPABILITY) and oneDNN's
# (ONEDNN_MAX_CPU_ISA), so its matmuls and attention take the paths that kind's CPU takes.
_TORCH_ENV = {
    "avx2": ("avx2", "AVX2"),
    "avx2-vnni": ("avx2", "AVX2_VNNI"),
    "avx512-vnni": ("avx512", "AVX512_CORE_VNNI"),
    "avx512-bf16": ("avx512", "AVX512_CORE_BF16"),
    "amx": ("avx512", "AVX512_CORE_AMX"),
}


# MKL, which serves PyTorch's float32 GEMMs, picks its code path on its own: held to AVX2 for the
# kinds without AVX-512, or an avx2 kind on an AVX-512 host multiplies at AVX-512's rate (one core of
# a Sapphire Rapids Xeon, 512x576 @ 576x3072: 174 GFLOP/s unrestricted, 109 with AVX2), and the
# crossover to the GEMM that prefill takes (models/quantized_linear.py) is measured wrong.
_MKL_ENV = {"avx2": "AVX2", "avx2-vnni": "AVX2"}
# Inductor's compiled kernels are cached on disk under keys that do not tell an AVX2 build from the
# host's AVX-512 one: a graph compiled natively and loaded again under ATEN_CPU_CAPABILITY=avx2
# returned NaN logits here (transformers' Llama under torch.compile, torch 2.13), so each kind that
# is not the host's compiles into a cache of its own.
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# Every variable `apply_cpu_kind_to_torch` may set: a child process of another kind drops them.
TORCH_KIND_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", INDUCTOR_CACHE_VAR)


def _kind_gated(flag: str) -> bool:
    """Flags that differ between the kinds: a kind without one hides it."""
    return flag.startswith(("avx512", "amx")) or flag == "avx_vnni"


@functools.cache
def native_cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_kind() -> str:
    """The kind `CADENZA_CPU` (or its older name `CADENZA_CPU_ISA`) names; `native` when unset.

    Raises ValueError for an unknown kind, or one needing a feature this CPU lacks."""
    raw = os.environ.get(environment.CPU.name, "").strip().lower()
    source = environment.CPU.name
    if not raw:
        raw, source = os.environ.get(environment.CPU_ISA.name, "").strip().lower(), environment.CPU_ISA.name
    kind = _LEGACY_NAMES.get(raw, raw) or NATIVE
    if kind == NATIVE:
        return kind
    if kind not in CPU_KINDS:
        raise ValueError(f"{source} must be one of {', '.join([NATIVE, *CPU_KINDS])}, not {raw!r}")
    missing = CPU_KINDS[kind] - native_cpu_flags()
    if missing:
        raise ValueError(f"{source}={raw} but this CPU lacks {', '.join(sorted(missing))}")
    return kind


def cpu_flags() -> frozenset[str]:
    """The flags of the CPU cadenza acts on: this one's, less what `CADENZA_CPU`'s kind lacks."""
    return _flags_of(cpu_kind())


@functools.cache
def _flags_of(kind: str) -> frozenset[str]:
    native = native_cpu_flags()
    if kind == NATIVE:
        return native
    return frozenset(f for f in native if not _kind_gated(f) or f in CPU_KINDS[kind])


def describe_cpu() -> str:
    """The kind and the features that matter to cadenza, for logs and benchmark records."""
    flags = cpu_flags()
    features = [f for f in ("avx2", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{cpu_kind()} ({' '.join(features) or 'no AVX2'})"


def apply_cpu_kind_to_torch(environ=os.environ) -> None:
    """Hold PyTorch's CPU kernels to `CADENZA_CPU`'s kind (unless the variables are set already).

    ATen and oneDNN read these once, when torch loads: called from `import cadenza`, so a process
    that imports cadenza first (the CLI, the tests' workers) sees the kind's arithmetic throughout.
    An unknown or impossible kind is left for `cpu_kind()` to report where it is used."""
    try:
        kind = cpu_kind()
    except ValueError:
        return
    if kind in _TORCH_ENV:
        aten, onednn = _TORCH_ENV[kind]
        environ.setdefault("ATEN_CPU_CAPABILITY", aten)
        environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        environ.setdefault(INDUCTOR_CACHE_VAR, os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_cadenza-{kind}"))
    if kind in _MKL_ENV:
        environ.setdefault("MKL_ENABLE_INSTRUCTIONS", _MKL_ENV[kind])


def runnable_kinds() -> list[str]:
    """The kinds this CPU can stand in for (its own features include theirs), weakest first."""
    native = native_cpu_flags()
    return [kind for kind, features in CPU_KINDS.items() if features <= native]


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).

    Without it, PyTorch's bfloat16 matmuls and attention take slow paths: several times slower
    than float32 once more than a few rows are multiplied at once.
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_avx2_fma() -> bool:
    """True on x86-64 CPUs with AVX2 and FMA: what cadenza's own CPU kernels need."""
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512_vnni() -> bool:
    """True where the CPU has AVX-512 (F, BW, VL) and its VNNI int8 dot products: the packed
    quantized kernels (kernels/cpu/quant_packed.h) need them."""
    return AVX512_VNNI_FLAGS <= cpu_flags()


def cpu_has_avx_vnni() -> bool:
    """True where the CPU has AVX-VNNI: 256-bit `vpdpbusd` without AVX-512 (Alder Lake and later)."""
    return "avx_vnni" in cpu_flags()
