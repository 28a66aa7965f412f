"""What the CPU can do natively, for choosing kernels."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).

    Without it, PyTorch's bfloat16 matmuls and attention take slow paths: several times slower
    than float32 once more than a few rows are multiplied at once.
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_avx2_fma() -> bool:
    """True on x86-64 CPUs with AVX2 and FMA: what cadenza's own CPU kernels need."""
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_flags()


AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


def cpu_has_avx512_vnni() -> bool:
    """True where the CPU has AVX-512 (F, BW, VL) and its VNNI int8 dot products: the packed
    quantized kernels (kernels/quant_packed.h) need them."""
    return AVX512_VNNI_FLAGS <= cpu_flags()
