"""cadenza's CPU kernels (kernels/cpu/*.cpp): compiled on first use, cached, and optional.

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
wait on the build lock instead of building twice (an flock, so that a build killed midway
leaves no lock behind: `_build_lock`).

One variant is chosen at build time from the CPU as `kernels/cpu/features.py` reads it (so
`CADENZA_CPU` picks it: the tests run each kind this machine can stand in for), and each variant is
its own extension, so all stay cached. They differ in the products over packed quantized weights
(kernels/cpu/quant_packed.h), a unit only that variant compiles, and in the instructions allowed:
`avx2` (AVX2 and FMA, weights packed 8 rows at a time, quant_packed8.cpp on vpmaddubsw), `avx2vnni`
(the same 8-row layout on AVX-VNNI's 256-bit vpdpbusd, Alder Lake and later) and `avx512vnni`
(16 rows at a time, quant_packed.cpp on 512-bit vpdpbusd). `path()` names the products; the build
logs it with the variant ("CPU kernels ready path=avx2-packed8 isa=avx2").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import structlog

from cadenza.kernels.cpu.features import cpu_flags, cpu_has_avx2_fma, cpu_has_avx512_vnni, cpu_has_avx_vnni

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")  # the binding: the one unit that includes torch
HEADERS = sorted(SOURCE.parent.glob("*.h"))
# Each build's units, compiled side by side (ninja): the binding first, as the longest to compile,
# then the kernels, the longest first. Each variant's packed products only in the builds that run them.
_KERNEL_UNITS = ("quant.cpp", "paged_attention.cpp", "linear.cpp", "small_ops.cpp", "decode_layer.cpp", "moe.cpp")
UNITS = {
    "avx2": (SOURCE.name, "quant_packed8.cpp", *_KERNEL_UNITS),
    "avx2vnni": (SOURCE.name, "quant_packed8.cpp", *_KERNEL_UNITS),
    "avx512vnni": (SOURCE.name, "quant_packed.cpp", *_KERNEL_UNITS),
}
MODES = ("auto", "on", "off")
ISAS = tuple(UNITS)
# Each variant's compiler flags beyond AVX2/FMA/F16C, and the rows its packed groups hold.
ISA_FLAGS = {
    "avx2": [],
    "avx2vnni": ["-mavxvnni"],
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}
PACK_ROWS = {"avx2": 8, "avx2vnni": 8, "avx512vnni": 16}


class KernelUnavailableError(RuntimeError):
    """cpu_kernels is "on" but the kernels cannot be built or run here; the message says why (the CLI
    reports it in one line, as it does a model that cannot load)."""


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
        log.info("CPU kernels ready", path=_built.packed_path(), isa=isa(), seconds=round(time.perf_counter() - started, 1))
        return _built, None


def isa() -> str:
    """The build variant for this CPU: the best it has, as `CADENZA_CPU` shows it (raises ValueError
    where that variable names a kind this CPU cannot be)."""
    # Every AVX-512 VNNI kind takes the 16-row zmm products, Zen 4 (`avx512-bf16`) included. That
    # choice for Zen 4 is reasoned, not measured (no Zen 4 here), from LLVM's Znver4 machine model
    # (built from AMD's optimization guide): Zen 4 runs a zmm integer multiply (vpdpbusd,
    # vpmaddubsw) as one op holding one of its two multiply pipes (FP0, FP3) for 2 cycles where a
    # ymm one holds it for 1, and likewise zmm shifts, logic and conversions (vcvtph2ps zmm: 4 ops
    # against ymm's 2), so the 8-row ymm products (the avx2vnni build's, on AVX-512 VL's vpdpbusd)
    # would multiply no faster per byte, while the 16-row zmm ones issue half the activation
    # broadcasts, loads and loop steps per byte of weights. At batch 1 neither is near those pipes'
    # limit (about 30 bytes of Q4_1 a cycle and core); what keeps a Zen 4 decode at half its
    # memory ceiling is more likely the many threads' synchronisation per product (for_each_tile's
    # shared counter across CCDs, a fork and join per product) than the zmm instructions.
    if cpu_has_avx512_vnni():
        return "avx512vnni"
    return "avx2vnni" if cpu_has_avx_vnni() else "avx2"


def path() -> str | None:
    """The built kernels' products over packed weights (e.g. "avx2-packed8"), None before or without a build."""
    return _built.packed_path() if _built is not None else None


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
    name = extension_name(target)
    try:
        with _build_lock(name):
            return load(
                name=name,
                sources=[str(f) for f in sources],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", *ISA_FLAGS[target], "-fopenmp",
                              f"-DCADENZA_PACK_ROWS={PACK_ROWS[target]}", f"-DCADENZA_SOURCES_DIGEST={digest.hexdigest()[:16]}"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    finally:
        if jobs_unset:
            os.environ.pop("MAX_JOBS", None)


def extension_name(target: str) -> str:
    """The PyTorch extension (and build folder) of build variant `target`."""
    return "cadenza_cpu_kernels" if target == "avx2" else f"cadenza_cpu_kernels_{target}"


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Held around PyTorch's build of extension `name`: an flock, which the kernel lets go when its
    holder dies, where PyTorch's own lock is a file that a builder killed mid-build (Ctrl-C on a
    first `cadenza serve`, a test's process group stopped) leaves behind, on which every later
    process then waits forever. Under the flock no other cadenza process is building `name`, so a
    PyTorch lock file found there is such a leftover, and goes."""
    try:
        import fcntl
    except ImportError:  # not POSIX: PyTorch's lock alone
        yield
        return
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "cadenza.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = build_dir / "lock"
            if leftover.exists():
                log.warning("Removing a build lock left by a build that died", path=str(leftover))
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
