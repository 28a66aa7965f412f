"""Build llama.cpp's own binaries (`llama-bench`, `llama-batched-bench`, `llama-server`, `llama-quantize`) for the benches, per CPU kind.

llama.cpp is the peer users compare a GGUF against, run the way its users run it: its binaries on
the file at the file's own precision. No wheel ships the binaries, so this builds them from the
llama.cpp source vendored in the `llama-cpp-python` sdist (pip downloads it from the package index),
with cmake, into a cache outside the repository (`~/.cache/cadenza/llama.cpp/<version>/`, or
`$CADENZA_LLAMACPP_HOME/<version>/`).

Each CPU kind cadenza can act as (`CADENZA_CPU`, kernels/cpu/features.py) gets llama.cpp compiled
for that kind's instruction set: the SIMD options come from `cpu_flags()` under the kind, so with
`CADENZA_CPU=avx2` both engines are held to AVX2 on this machine. AMX stays off for every kind:
ggml's AMX kernels die with a general-protection fault on this VM's Sapphire Rapids.

The build is shared the way llama.cpp's own releases are (`GGML_BACKEND_DL`): the tools and
libllama are compiled once, without any SIMD flags, and each kind adds only its CPU backend
(`libggml-cpu.so`, a fifth of the compile), which the tools load from their own directory. Not
`GGML_CPU_ALL_VARIANTS`: that compiles 14 x86 variants to use one. Layout of the cache:

    <version>/build/source      the llama.cpp source, kept for the next kind
    <version>/build/base        the kind-independent build (tools, libllama, libggml, libggml-base)
    <version>/<kind>/bin        what a kind runs: the tools, the shared libraries, its libggml-cpu.so

About 15 minutes on 2 cores for the first kind, a few minutes for each other; later calls find the
binaries and return at once (`rm -r <version>/build` once every kind needed is built).

    python -m cadenza.bench.peers.llamacpp_build                         # CADENZA_CPU's kind (native when unset)
    python -m cadenza.bench.peers.llamacpp_build --kinds avx2 native     # these kinds
    python -m cadenza.bench.peers.llamacpp_build --where                 # print the bin directory if built, else exit 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

from cadenza.config import environment
from cadenza.kernels.cpu import features as cpu_features

SDIST = "llama-cpp-python==0.3.36"  # pinned: the llama.cpp revision the benches were measured against
VERSION = SDIST.split("==")[1]
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
CPU_BACKEND = "libggml-cpu.so"  # the kind's CPU backend, loaded by the tools from their own directory

# Options of every configure: shared libraries with loadable backends, tools only, no network
# (the server's web UI would be downloaded), and an rpath of $ORIGIN so a kind's bin directory
# runs wherever it is copied.
_COMMON_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)


def cache_root() -> Path:
    home = os.environ.get(environment.LLAMACPP_HOME.name)
    return Path(home) if home else Path.home() / ".cache" / "cadenza" / "llama.cpp"


def version_dir() -> Path:
    return cache_root() / VERSION


def bin_dir(kind: str | None = None) -> Path:
    """Where `kind`'s binaries are (default: the kind `CADENZA_CPU` names, as every caller runs)."""
    return version_dir() / (kind or cpu_features.cpu_kind()) / "bin"


def find_binary(name: str, kind: str | None = None) -> Path | None:
    """The cached binary `name` for `kind` (default `CADENZA_CPU`'s), or None when it was never built."""
    path = bin_dir(kind) / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_command(kind: str | None = None) -> str:
    """The command that builds `kind`'s binaries."""
    suffix = f" --kinds {kind}" if kind else ""
    return f"python -m cadenza.bench.peers.llamacpp_build{suffix}"


def why_binaries_missing(kind: str | None = None) -> str | None:
    """A skip reason naming the build command when any of `kind`'s binaries is absent, else None."""
    try:
        kind = kind or cpu_features.cpu_kind()
    except ValueError as exc:
        return f"no llama.cpp for this CPU kind: {exc}"
    where = bin_dir(kind)
    missing = [t for t in TARGETS if find_binary(t, kind) is None]
    missing += [] if (where / CPU_BACKEND).is_file() else [CPU_BACKEND]
    if not missing:
        return None
    return (f"llama.cpp binaries for CPU kind {kind} not built ({', '.join(missing)} missing in {where}); "
            f"build them once with `{build_command(kind)}` (about 15 min on 2 cores, a few for each further kind)")


# /proc/cpuinfo flag -> the ggml option that compiles for it (all of an option's flags must be present).
# AVX-512 asks only for F, BW and VL, the base cpu_features' kinds name: every CPU with those three
# (Skylake-SP on, Zen 4) has CD and DQ too, which ggml's option also compiles for, and a kind hides
# flags it does not name (avx512-bf16 has no avx512cd in cpu_flags()).
_X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",), "GGML_F16C": ("f16c",), "GGML_FMA": ("fma",), "GGML_BMI2": ("bmi2",),
    "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512vl"),
    "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
}
_AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_options(flags: frozenset[str]) -> list[str]:
    """cmake options for a CPU with `flags`: on x86-64 each SIMD extension it has, named (not
    -march=native, which would also compile ggml's AMX path and every feature the kind hides);
    elsewhere -march=native."""
    if "avx2" not in flags:
        return ["-DGGML_NATIVE=ON"]
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{name}={'ON' if all(f in flags for f in needs) else 'OFF'}" for name, needs in _X86_OPTIONS.items()]
    return options + list(_AMX_OFF)


def kind_flags(kind: str) -> frozenset[str]:
    """The flags cadenza acts on as `kind` (`cpu_flags()` with `CADENZA_CPU=kind`); ValueError when
    this CPU cannot stand in for it."""
    with _acting_as(kind):
        cpu_features.cpu_kind()  # refuses a kind this CPU lacks the features of
        return cpu_features.cpu_flags()


@contextlib.contextmanager
def _acting_as(kind: str) -> Iterator[None]:
    saved = os.environ.get(environment.CPU.name)
    os.environ[environment.CPU.name] = kind
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(environment.CPU.name, None)
        else:
            os.environ[environment.CPU.name] = saved


def build(kind: str | None = None, jobs: int | None = None) -> Path:
    """Build (or find) `kind`'s binaries (default `CADENZA_CPU`'s kind); returns their directory."""
    kind = kind or cpu_features.cpu_kind()
    options = cpu_options(kind_flags(kind))
    if why_binaries_missing(kind) is None:
        return bin_dir(kind)
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not installed; llama.cpp builds with cmake")
    jobs = jobs or os.cpu_count() or 1
    work = version_dir() / "build"
    work.mkdir(parents=True, exist_ok=True)
    with locked(work / ".lock"):
        if why_binaries_missing(kind) is None:  # another process built it while this one waited
            return bin_dir(kind)
        source = _source(work)
        base = work / "base"
        # The kind-independent part: no CPU backend at all here, so nothing in it is compiled for a kind.
        _configure(source, base, ["-DGGML_CPU=OFF"])
        _compile(base, TARGETS, jobs)
        cpu = work / f"cpu-{kind}"
        _configure(source, cpu, options)
        _compile(cpu, ("ggml-cpu",), jobs)
        _install(base / "bin", cpu / "bin" / CPU_BACKEND, bin_dir(kind))
        shutil.rmtree(cpu, ignore_errors=True)
    return bin_dir(kind)


def source_dir() -> Path:
    """The llama.cpp source (with its `convert_hf_to_gguf.py` and `gguf-py`), downloaded once into
    the cache; the same tree the binaries build from."""
    work = version_dir() / "build"
    work.mkdir(parents=True, exist_ok=True)
    with locked(work / ".lock"):
        return _source(work)


def _source(work: Path) -> Path:
    """The vendored llama.cpp, downloaded and unpacked once into `work`/source."""
    source = work / "source"
    if (source / "CMakeLists.txt").is_file():
        return source
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", tmp, SDIST])
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as archive:
            archive.extractall(tmp, filter="data")
        shutil.rmtree(source, ignore_errors=True)
        next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")).rename(source)
    return source


def _configure(source: Path, build_dir: Path, options: list[str]) -> None:
    _run(["cmake", "-S", str(source), "-B", str(build_dir), *_COMMON_OPTIONS, *options])


def _compile(build_dir: Path, targets: tuple[str, ...], jobs: int) -> None:
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *targets])


def _install(base_bin: Path, cpu_backend: Path, target: Path) -> None:
    """The tools, every shared library beside them (symlinks kept) and the kind's CPU backend into
    `target`, swapped in whole so a reader never sees half a directory."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in [*(base_bin / t for t in TARGETS), *sorted(base_bin.glob("lib*.so*"))]:
        shutil.copy2(path, staging / path.name, follow_symlinks=False)
    shutil.copy2(cpu_backend, staging / CPU_BACKEND)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One writer at a time under `path` (an exclusive file lock): a second waits for the first
    (a build of a kind, a shape's GGUF)."""
    import fcntl

    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str]) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=[cpu_features.NATIVE, *cpu_features.CPU_KINDS], metavar="KIND",
                        help="CPU kinds to build for (default: the one CADENZA_CPU names, native when unset)")
    parser.add_argument("--where", action="store_true", help="print the bin directories if built, else exit 1")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args(argv)
    kinds = args.kinds or [cpu_features.cpu_kind()]
    if args.where:
        whys = [why for why in map(why_binaries_missing, kinds) if why]
        for why in whys:
            print(why, file=sys.stderr)
        if not whys:
            print("\n".join(str(bin_dir(kind)) for kind in kinds))
        return 1 if whys else 0
    for kind in kinds:
        print(build(kind, args.jobs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
