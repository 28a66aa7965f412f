"""cadenza's CPU kernels (kernels/*.cpp): compiled on first use, cached, and optional.

`configure(mode)` says whether a model uses them (the build happens once per process): "auto"
builds them where the CPU has AVX2 and FMA and a C++ compiler is at hand, and falls back to
PyTorch's ops (with a warning naming why) otherwise; "on" raises `KernelUnavailableError` instead
of falling back; "off" never builds them. It returns the compiled module, or None where the PyTorch
path runs; each model keeps the module it was given.

The build compiles its units side by side: the binding (`cpu_kernels.cpp`, the one unit that
includes torch, and only the headers it needs) and the kernels (plain C++ over pointers, see
kernels.h), about 13 s on two cores, where one unit under <torch/extension.h> took 30-34 s (about
20 of them in torch's headers). It goes to PyTorch's extension cache (`TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions) and is reused until a source or header changes; concurrent processes
wait on PyTorch's build lock instead of building twice. It targets AVX2 and FMA, plus AVX-512 VNNI
where the CPU has it (the packed quantized kernels, quant_packed.cpp, a unit only that build
compiles), as `models/cpu_features.py` reads the CPU: `CADENZA_CPU=avx2` builds the AVX2-only
variant on such a CPU (tests use it to check that path). Each variant is its own extension, so
both stay cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import structlog

from cadenza.models.cpu_features import cpu_flags, cpu_has_avx2_fma, cpu_has_avx512_vnni
from cadenza.models.errors import ModelLoadError

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")  # the binding: the one unit that includes torch
HEADERS = sorted(SOURCE.parent.glob("*.h"))
# Each build's units, compiled side by side (ninja): the binding first, as the longest to compile,
# then the kernels, the longest first. The AVX-512 VNNI products only in the build that runs them.
_KERNEL_UNITS = ("quant.cpp", "paged_attention.cpp", "linear.cpp", "small_ops.cpp", "decode_layer.cpp")
UNITS = {
    "avx2": (SOURCE.name, *_KERNEL_UNITS),
    "avx512vnni": (SOURCE.name, "quant_packed.cpp", *_KERNEL_UNITS),
}
MODES = ("auto", "on", "off")
ISAS = ("avx2", "avx512vnni")


class KernelUnavailableError(ModelLoadError):
    """cpu_kernels is "on" but the kernels cannot be built or run here; the message says why."""


_lock = threading.Lock()
_built: ModuleType | None = None
_build_error: str | None = None


def configure(mode: str) -> ModuleType | None:
    """The compiled kernels for `mode` (see the module docstring), or None: PyTorch's ops."""
    if mode not in MODES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    module, why = _build()
    if module is None and mode == "on":
        raise KernelUnavailableError(f"cpu_kernels is 'on' but the CPU kernels are unavailable: {why}")
    return module


def build_error() -> str | None:
    """Why the kernels did not build (None: they did, or no build was tried yet)."""
    return _build_error


def _build() -> tuple[ModuleType | None, str | None]:
    global _built, _build_error
    with _lock:
        if _built is not None or _build_error is not None:
            return _built, _build_error
        if not cpu_has_avx2_fma() or "f16c" not in cpu_flags():
            _build_error = "the CPU lacks AVX2/FMA/F16C (or is not x86-64)"
            log.info("CPU kernels unavailable; using PyTorch ops", reason=_build_error)
            return None, _build_error
        started = time.perf_counter()
        try:
            _built = _compile()
        except Exception as exc:  # a missing compiler, ninja or header: fall back, say why
            _build_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            log.warning("Could not build the CPU kernels; using PyTorch ops", reason=_build_error)
            return None, _build_error
        log.info("CPU kernels ready", seconds=round(time.perf_counter() - started, 1))
        return _built, None


def isa() -> str:
    """The instruction set the kernels are built for: the best the CPU has, as `CADENZA_CPU` shows it
    (raises ValueError where that variable names a kind this CPU cannot be)."""
    return "avx512vnni" if cpu_has_avx512_vnni() else "avx2"


ISA_FLAGS = {"avx2": [], "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]}


def _compile() -> ModuleType:
    from torch.utils.cpp_extension import load

    # ninja from the virtualenv (the `ninja` wheel, a dependency) is on PATH only when the
    # virtualenv is activated: put it first, so the build never depends on a system ninja.
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and shutil.which("ninja") != str(Path(bin_dir) / "ninja"):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # ninja rebuilds a unit when its source or a header it includes is newer than its object; the
    # digest of every source and header goes into the flags too, so that files older than the
    # cached build (an installed wheel keeps its files' times) still rebuild it.
    target = isa()
    sources = [SOURCE.parent / unit for unit in UNITS[target]]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in [*sorted(SOURCE.parent.glob("*.cpp")), *HEADERS]))
    # One compile a core (unless MAX_JOBS says otherwise): ninja's default, two more, time-shares
    # the binding, the longest unit, with the kernels' units and ends later.
    jobs_unset = "MAX_JOBS" not in os.environ
    if jobs_unset:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ["MAX_JOBS"] = str(cores or 1)
    try:
        return load(
            name="cadenza_cpu_kernels" if target == "avx2" else f"cadenza_cpu_kernels_{target}",
            sources=[str(f) for f in sources],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", *ISA_FLAGS[target], "-fopenmp",
                          f"-DCADENZA_SOURCES_DIGEST={digest.hexdigest()[:16]}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    finally:
        if jobs_unset:
            os.environ.pop("MAX_JOBS", None)
