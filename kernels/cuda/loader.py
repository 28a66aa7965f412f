"""Finds cupy, compiles the kernels' CUDA C with NVRTC on first use, and decides kernel or torch.

An op in this package runs its cupy kernel on a CUDA tensor when all of these hold, and its torch
fallback otherwise:
- torch is a CUDA build and cupy imports (`pip install cadenza[cuda]`);
- cupy's CUDA major version is torch's (`torch.version.cuda`): cupy-cuda12x under a CUDA 12
  torch, cupy-cuda13x under CUDA 13. Two majors would load two CUDA runtimes into one process;
- the kernel's module compiles. NVRTC compiles it at first use (no nvcc needed, at install time or
  ever); cupy keeps the binary in ~/.cupy/kernel_cache (`CUPY_CACHE_DIR`), so later processes load it.
Each of those is decided once per process, and a fallback is logged once, naming why.

Kernels launch on torch's current stream of the tensors' device, so they are ordered with
torch's own work, and a launch can be captured in a CUDA graph; the first call compiles, so make it
before capture (a warm-up step does). Tensors reach the kernels as cupy arrays over their own
memory (`as_cupy`): nothing is copied.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import threading
import time
from types import ModuleType
from typing import Any, Sequence

import structlog
import torch

log = structlog.get_logger(__name__)

# cupy >= 13 compiles with -std=c++14 by default; said here so older ones do the same.
NVRTC_OPTIONS = ("-std=c++14",)

_lock = threading.Lock()
_cupy_checked = False
_cupy: ModuleType | None = None
_cupy_error: str | None = None
_kernels: dict[str, dict[str, Any]] = {}  # by source file: the kernels compiled from it, by name
_kernel_errors: dict[str, str] = {}  # by source file: why it did not compile


def reset() -> None:
    """Forget every decision and compiled module (for tests: the next call decides afresh)."""
    global _cupy_checked, _cupy, _cupy_error
    with _lock:
        _cupy_checked, _cupy, _cupy_error = False, None, None
        _kernels.clear()
        _kernel_errors.clear()


def _import_cupy() -> ModuleType:
    """`import cupy`; tests replace this with a fake."""
    return importlib.import_module("cupy")


def cupy_cuda_major(cupy: ModuleType) -> int | None:
    """The CUDA major version cupy was built for (12 for cupy-cuda12x), None where unknown."""
    try:
        # The CUDA runtime cupy loaded, e.g. 12080 for 12.8; asking it needs no GPU.
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - an odd build: fall back on the wheel's name
        pass
    for major in (11, 12, 13, 14):
        try:
            importlib.metadata.version(f"cupy-cuda{major}x")
            return major
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _find_cupy() -> tuple[ModuleType | None, str | None, str]:
    """(cupy or None, why not, the level to log that at): info where cupy is simply not there,
    warning where it is there but cannot be used."""
    torch_cuda = torch.version.cuda
    if not torch_cuda:
        return None, "torch is not a CUDA build (torch.version.cuda is None)", "info"
    torch_major = int(torch_cuda.split(".")[0])
    wheel = f"cupy-cuda{torch_major}x"
    try:
        cupy = _import_cupy()
    except ImportError as exc:
        return None, f"cupy is not installed ({exc}); torch is built for CUDA {torch_cuda}: install {wheel}", "info"
    except Exception as exc:  # noqa: BLE001 - installed, but a CUDA library it needs fails to load
        return None, f"cupy does not import ({type(exc).__name__}: {exc})", "warning"
    cupy_major = cupy_cuda_major(cupy)
    if cupy_major != torch_major:
        return None, f"cupy is built for CUDA {cupy_major} but torch for CUDA {torch_cuda}: install {wheel} instead", "warning"
    return cupy, None, "info"


def cupy_or_reason() -> tuple[ModuleType | None, str | None]:
    """(cupy, None) where cupy can run kernels on torch's tensors, else (None, why). Decided once;
    the first call logs a fallback (info where cupy is simply absent, warning where it is wrong)."""
    global _cupy_checked, _cupy, _cupy_error
    with _lock:
        if not _cupy_checked:
            _cupy, _cupy_error, level = _find_cupy()
            _cupy_checked = True
            if _cupy is None:
                getattr(log, level)("cupy kernels unavailable; using torch ops", reason=_cupy_error)
        return _cupy, _cupy_error


def load_kernels(source: str, names: Sequence[str], device: torch.device) -> dict[str, Any] | None:
    """The kernels `names` (extern "C" functions) of `kernels/cuda/<source>`, compiled by NVRTC on
    `device` at the first call, as {name: cupy RawKernel}; None where cupy is unavailable or the
    source does not compile (logged once, with NVRTC's message)."""
    cupy, _ = cupy_or_reason()
    if cupy is None:
        return None
    with _lock:
        if source in _kernels:
            return _kernels[source]
        if source in _kernel_errors:
            return None
        started = time.perf_counter()
        try:
            code = importlib.resources.files(__package__).joinpath(source).read_text(encoding="utf-8")
            with cupy.cuda.Device(device.index if device.index is not None else 0):
                module = cupy.RawModule(code=code, options=NVRTC_OPTIONS)
                # get_function compiles and loads the module on the current device: a failure
                # shows here, not in the middle of a step. Other devices compile on first launch.
                kernels = {name: module.get_function(name) for name in names}
        except Exception as exc:  # noqa: BLE001 - NVRTC's CompileException, a missing libnvrtc, ...
            message = str(exc).strip()
            _kernel_errors[source] = f"{type(exc).__name__}: {message[:2000]}"
            log.warning("Could not compile cupy kernels; using torch ops", source=source, reason=_kernel_errors[source])
            return None
        _kernels[source] = kernels
        log.info("cupy kernels ready", source=source, seconds=round(time.perf_counter() - started, 2))
        return kernels


def kernel_error(source: str) -> str | None:
    """Why `source`'s kernels are not in use (None: they are, or were not asked for yet)."""
    if _cupy_checked and _cupy is None:
        return _cupy_error
    return _kernel_errors.get(source)


def kernels_for(source: str, names: Sequence[str], device: torch.device) -> dict[str, Any] | None:
    """The dispatch decision: `source`'s compiled kernels for tensors on `device`, or None where
    the torch fallback runs (a CPU device is no failure, and logs nothing)."""
    if device.type != "cuda":
        return None
    return load_kernels(source, names, device)


# cupy has no bfloat16: such tensors are seen as their bits, and the kernels convert them.
_CUPY_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "uint16",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def as_cupy(tensor: torch.Tensor) -> Any:
    """A cupy array over a CUDA tensor's own memory, with its shape and strides: no copy, and the
    array keeps the tensor alive. This is what `cupy.asarray` makes of `__cuda_array_interface__`,
    except that the device is named rather than asked of the driver for every array."""
    cupy = _cupy
    assert cupy is not None and tensor.is_cuda, "as_cupy needs cupy and a CUDA tensor"
    itemsize = tensor.element_size()
    span = 0 if tensor.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), span * itemsize, tensor, tensor.device.index)
    strides = tuple(s * itemsize for s in tensor.stride())
    return cupy.ndarray(tuple(tensor.shape), _CUPY_DTYPES[tensor.dtype], cupy.cuda.MemoryPointer(memory, 0), strides)


def launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, device: torch.device) -> None:
    """Run `kernel` on torch's current stream of `device` (so in order with torch's work, and
    inside a CUDA graph while one is being captured)."""
    cupy = _cupy
    assert cupy is not None, "launch needs cupy"
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        kernel(grid, block, args, stream=stream)
