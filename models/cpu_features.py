"""What the CPU can do natively, for choosing kernels."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).

    Without it, PyTorch's bfloat16 matmuls and attention take slow paths: several times slower
    than float32 once more than a few rows are multiplied at once.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))
