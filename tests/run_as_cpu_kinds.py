"""Run the CPU-sensitive tests once as each other kind of CPU this machine can stand in for.

The suite proper runs as this CPU; the kernels, the quantized path, int8 weights and KV, tensor
parallelism on the GGUF, speculative identity and the models' parity with transformers take
other paths on other CPUs (no AVX-512: blocks packed 8 rows at a time for 256-bit products,
vpmaddubsw or AVX-VNNI's vpdpbusd, float32 matmul copies and attention; no native bf16: float32
activations), so `make test` runs them again as each kind whose decisions differ from this CPU's
(`CADENZA_CPU`, kernels/cpu/features.py): a kind that differs from one already run only in the
packed products' instructions runs the products' tests alone, one of the same build variant but
other bf16 or AMX decisions all but the variant's and the ranks' tests, and no kind runs the tests
of processes (PROCESS_TESTS). Exit status: 0 when every kind passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cadenza.config import environment
from cadenza.kernels.cpu import features as cpu_features

TESTS = Path(__file__).parent
CPU_SENSITIVE = [
    "test_cpu_isa.py", "test_cpu_kernels.py", "test_quantized.py", "test_quantized_quality.py",
    "test_int8_weights.py", "test_kv_int8.py", "test_decode_stack.py", "test_gguf_model.py",
    "test_model_parity.py", "test_attention_backends.py", "test_tensor_parallel.py", "test_speculative.py",
    "test_moe.py", "test_mxfp4.py", "test_gpt_oss.py",
]  # fmt: skip
# What a kind runs when it differs from a kind already run only in the instructions of the packed
# products (avx2-vnni after avx2: the same 8-row layout, vpdpbusd for vpmaddubsw): the tests of those
# products and of the models on them, about a minute instead of the whole set's two or three.
PRODUCTS_SENSITIVE = [
    "test_cpu_isa.py", "test_quantized.py", "test_quantized_quality.py", "test_int8_weights.py",
    "test_decode_stack.py", "test_gguf_model.py", "test_mxfp4.py",
]  # fmt: skip


# What a kind runs when its packed layout is one already run but it decides bf16 or AMX otherwise
# (avx512-vnni and avx512-bf16 on a Xeon with AMX): the whole set but the tests of the build variants
# and of splitting weights across ranks, whose paths follow the layout alone.
DECISIONS_SENSITIVE = [name for name in CPU_SENSITIVE if name not in ("test_cpu_isa.py", "test_tensor_parallel.py")]
# Tests of processes, not of kernel paths (a rank started by torchrun, a rank that dies, `serve --tp 2`):
# the suite proper runs them; as another kind they took about a minute a kind.
PROCESS_TESTS = [
    "test_tensor_parallel.py::test_torchrun_makes_rank_0_the_server_and_rank_1_a_model_worker",
    "test_tensor_parallel.py::test_serve_with_tp2_spawns_its_rank_and_health_fails_when_it_dies",
    "test_tensor_parallel.py::test_a_rank_killed_mid_run_fails_the_requests_and_the_engine_and_nothing_hangs",
]


def decisions(kind: str) -> tuple:
    """What cadenza decides from the CPU as `kind`: kinds that decide alike test alike."""
    os.environ[environment.CPU.name] = kind
    try:
        from cadenza.kernels.cpu import loader as cpu

        # AMX decides where packed weights take the de-quantized GEMM (models/quantized_linear.py).
        return (cpu.isa(), cpu_features.cpu_has_native_bf16(), cpu_features.AMX_FLAGS <= cpu_features.cpu_flags())
    finally:
        del os.environ[environment.CPU.name]


def _layout(decided: tuple) -> tuple:
    """The decisions but the packed products' instructions: the packed layout and the bf16 choice."""
    from cadenza.kernels.cpu import loader as cpu

    isa, bf16, amx = decided
    return (cpu.PACK_ROWS[isa], bf16, amx)


def kinds_to_run() -> list[tuple[str, list[str]]]:
    """(kind, test files) for every kind whose decisions differ from this CPU's and the kinds before it."""
    here = decisions(cpu_features.NATIVE)
    chosen, seen = [], {here}
    for kind in cpu_features.runnable_kinds():
        if (d := decisions(kind)) not in seen:
            if _layout(d) in {_layout(s) for s in seen}:
                files = PRODUCTS_SENSITIVE
            elif d[0] in {s[0] for s in seen}:  # the same build variant, other bf16 or AMX decisions
                files = DECISIONS_SENSITIVE
            else:
                files = CPU_SENSITIVE
            chosen.append((kind, files))
            seen.add(d)
    return chosen


def main(argv: list[str]) -> int:
    if not cpu_features.cpu_has_avx2_fma():
        print("cpu kinds: this CPU has no AVX2; nothing to stand in for")
        return 0
    kinds = kinds_to_run()
    what = {id(CPU_SENSITIVE): "", id(DECISIONS_SENSITIVE): " (but the layout's own tests)", id(PRODUCTS_SENSITIVE): " (packed products' tests)"}
    names = [kind + what[id(files)] for kind, files in kinds]
    print(f"cpu kinds: this CPU is {cpu_features.describe_cpu()}; running the CPU-sensitive tests as: {', '.join(names) or 'none'}")
    failed = []
    for kind, files in kinds:
        env = {**os.environ, environment.CPU.name: kind}
        env.pop(environment.CPU_ISA.name, None)
        for name in cpu_features.TORCH_KIND_VARS:  # the kind sets PyTorch's, as `import cadenza` does
            env.pop(name, None)
        started = time.monotonic()
        print(f"\n== as {kind} ({environment.CPU.name}={kind}) ==", flush=True)
        # Node ids as pytest writes them: from the root folder (pyproject.toml's, beside tests/).
        deselect = [arg for test in PROCESS_TESTS if test.split("::")[0] in files
                    for arg in ("--deselect", f"{TESTS.name}/{test}")]  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv, *deselect,
                               *(str(TESTS / name) for name in files)], env=env)
        print(f"== as {kind}: {'passed' if done.returncode == 0 else 'FAILED'} in {time.monotonic() - started:.0f} s ==", flush=True)
        if done.returncode != 0:
            failed.append(kind)
    if failed:
        print(f"cpu kinds: failed as {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
