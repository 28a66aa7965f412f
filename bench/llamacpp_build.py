"""Build llama.cpp's own binaries (`llama-bench`, `llama-batched-bench`, `llama-server`) for the benches.

llama.cpp is the peer users compare a GGUF against, run the way its users run it: its binaries on
the file at the file's own precision. No wheel ships the binaries, so this builds them from the
llama.cpp source vendored in the `llama-cpp-python` sdist (pip downloads it from the package index),
with cmake, for this machine's CPU (every SIMD extension /proc/cpuinfo lists, AMX left out: ggml's AMX
kernels die with a general-protection fault on this VM's Sapphire Rapids), into a cache outside the repository
(`~/.cache/cadenza/llama.cpp/<version>/bin`, or `$CADENZA_LLAMACPP_HOME`). About 15 minutes on
2 cores; later calls find the binaries and return at once.

    python -m cadenza.bench.llamacpp_build            # build (or find) and print the bin directory
    python -m cadenza.bench.llamacpp_build --where    # print it only if already built, else exit 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from cadenza import environment

SDIST = "llama-cpp-python==0.3.36"  # pinned: the llama.cpp revision the benches were measured against
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server")


def cache_root() -> Path:
    home = os.environ.get(environment.LLAMACPP_HOME.name)
    return Path(home) if home else Path.home() / ".cache" / "cadenza" / "llama.cpp"


def bin_dir() -> Path:
    return cache_root() / SDIST.split("==")[1] / "bin"


def find_binary(name: str) -> Path | None:
    """The cached binary `name`, or None when it was never built (`python -m cadenza.bench.llamacpp_build`)."""
    path = bin_dir() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def why_binaries_missing() -> str | None:
    """A skip reason naming the build command when any binary is absent, else None."""
    missing = [t for t in TARGETS if find_binary(t) is None]
    if not missing:
        return None
    return (f"llama.cpp binaries not built ({', '.join(missing)} missing in {bin_dir()}); "
            "build them once with `python -m cadenza.bench.llamacpp_build` (about 15 min on 2 cores)")


def build(jobs: int | None = None) -> Path:
    if why_binaries_missing() is None:
        return bin_dir()
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not installed; llama.cpp builds with cmake")
    target_bin = bin_dir()
    work = Path(tempfile.mkdtemp(prefix="llamacpp-build-", dir=cache_root().parent if cache_root().parent.exists() else None))
    try:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(work), SDIST])
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
              *_cpu_options(), "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
        _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1),
              "--target", *TARGETS])
        target_bin.mkdir(parents=True, exist_ok=True)
        for name in TARGETS:
            shutil.copy2(build_dir / "bin" / name, target_bin / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target_bin


# /proc/cpuinfo flag -> the ggml option that compiles for it (all of an option's flags must be present).
_X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",), "GGML_F16C": ("f16c",), "GGML_FMA": ("fma",), "GGML_BMI2": ("bmi2",),
    "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
}


def _cpu_options() -> list[str]:
    """cmake options for this CPU: on x86-64 each SIMD extension it has, named (not -march=native,
    which would also compile ggml's AMX path); elsewhere -march=native."""
    try:
        flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), set())
    except OSError:
        flags = set()
    if "avx2" not in flags:
        return ["-DGGML_NATIVE=ON"]
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{name}={'ON' if all(f in flags for f in needs) else 'OFF'}" for name, needs in _X86_OPTIONS.items()]
    return options + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _run(command: list[str]) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", action="store_true", help="print the bin directory if built, else exit 1")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args(argv)
    if args.where:
        why = why_binaries_missing()
        if why:
            print(why, file=sys.stderr)
            return 1
        print(bin_dir())
        return 0
    cache_root().mkdir(parents=True, exist_ok=True)
    print(build(args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
