"""Run the CPU-sensitive tests once as each other kind of CPU this machine can stand in for.

The suite proper runs as this CPU; the kernels, the quantized path, int8 weights and KV, tensor
parallelism on the GGUF, speculative identity and the models' parity with transformers take
other paths on other CPUs (no AVX-512: the file's block layout, no packing, float32 matmul copies
and attention; no native bf16: float32 activations), so `make test` runs them again as each kind
whose decisions differ from this CPU's (`CADENZA_CPU`, models/cpu_features.py). Exit status: 0
when every kind passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cadenza import environment
from cadenza.models import cpu_features

TESTS = Path(__file__).parent
CPU_SENSITIVE = [
    "test_cpu_isa.py", "test_cpu_kernels.py", "test_quantized.py", "test_quantized_quality.py",
    "test_int8_weights.py", "test_kv_int8.py", "test_decode_stack.py", "test_gguf_model.py",
    "test_model_parity.py", "test_attention_backends.py", "test_tensor_parallel.py", "test_speculative.py",
]  # fmt: skip


def decisions(kind: str) -> tuple:
    """What cadenza decides from the CPU as `kind`: kinds that decide alike test alike."""
    os.environ[environment.CPU.name] = kind
    try:
        from cadenza.kernels import cpu

        return (cpu.isa(), cpu_features.cpu_has_native_bf16())
    finally:
        del os.environ[environment.CPU.name]


def kinds_to_run() -> list[str]:
    here = decisions(cpu_features.NATIVE)
    chosen, seen = [], {here}
    for kind in cpu_features.runnable_kinds():
        if (d := decisions(kind)) not in seen:
            chosen.append(kind)
            seen.add(d)
    return chosen


def main(argv: list[str]) -> int:
    if not cpu_features.cpu_has_avx2_fma():
        print("cpu kinds: this CPU has no AVX2; nothing to stand in for")
        return 0
    kinds = kinds_to_run()
    print(f"cpu kinds: this CPU is {cpu_features.describe_cpu()}; running the CPU-sensitive tests as: {', '.join(kinds) or 'none'}")
    failed = []
    for kind in kinds:
        env = {**os.environ, environment.CPU.name: kind}
        env.pop(environment.CPU_ISA.name, None)
        env.pop("ATEN_CPU_CAPABILITY", None)  # the kind sets PyTorch's, as `import cadenza` does
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        started = time.monotonic()
        print(f"\n== as {kind} ({environment.CPU.name}={kind}) ==", flush=True)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv,
                               *(str(TESTS / name) for name in CPU_SENSITIVE)], env=env)
        print(f"== as {kind}: {'passed' if done.returncode == 0 else 'FAILED'} in {time.monotonic() - started:.0f} s ==", flush=True)
        if done.returncode != 0:
            failed.append(kind)
    if failed:
        print(f"cpu kinds: failed as {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
