"""Every environment variable cadenza reads, declared once.

The config loader reads any other `CADENZA_*` variable as a config key (`CADENZA_SERVER__PORT`),
so a variable that is not a config key must be listed here, or setting it stops the CLI with
"unknown key". Each module that reads one takes its name from here. Importing this module costs
nothing (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its name, what it does, and an example value that is valid anywhere."""

    name: str
    description: str
    example: str


CONFIG = EnvVar("CADENZA_CONFIG", "A deployment YAML file (or a shipped preset name) to load when no --config is given.", "default")
PLUGINS = EnvVar("CADENZA_PLUGINS", "Comma-separated allowlist of the entry-point plugins that load (empty: none).", "")
CPU = EnvVar(
    "CADENZA_CPU",
    "The CPU kind cadenza acts as if it ran on: native (this CPU), avx2 (no AVX-512, no native bf16), "
    "avx2-vnni (AVX2 with 256-bit VNNI), avx512-vnni, avx512-bf16 (Zen 4), amx (Sapphire Rapids and "
    "later). Every decision that reads the CPU's features goes through it: the kernel build, packed "
    "layouts, cpu_fp32_matmul auto and the KV dtype. A kind needing a feature this CPU lacks is refused.",
    "avx2",
)
CPU_ISA = EnvVar("CADENZA_CPU_ISA", "The older name of CADENZA_CPU (its values avx2 and avx512vnni are still read).", "avx2")
LLAMACPP_HOME = EnvVar("CADENZA_LLAMACPP_HOME", "Where `cadenza bench` finds or builds llama.cpp's binaries.", "/tmp/llama.cpp")
PARALLEL_CONFIG = EnvVar("CADENZA_PARALLEL_CONFIG", "Internal: the deployment config, as JSON, that a tensor-parallel rank starts with.", "")
REPLICA_CONFIG = EnvVar("CADENZA_REPLICA_CONFIG", "Internal: the deployment config, as JSON, that a data-parallel replica starts with.", "")
REPLICA_INDEX = EnvVar("CADENZA_REPLICA_INDEX", "Internal: a data-parallel replica's index.", "0")
REPLICA_HOST = EnvVar("CADENZA_REPLICA_HOST", "Internal: the address a data-parallel replica listens on.", "127.0.0.1")
# OpenMP's own: read once by libgomp when torch loads. `import cadenza` sets GOMP_SPINCOUNT where
# neither is set (compute_thread.apply_openmp_defaults; docs/cpu-threads.md).
OMP_WAIT_POLICY = EnvVar(
    "OMP_WAIT_POLICY",
    "OpenMP's wait policy for torch's and the kernels' threads: PASSIVE sleeps at once (slower alone), "
    "ACTIVE spins. When set, cadenza leaves GOMP_SPINCOUNT to libgomp.",
    "PASSIVE",
)
GOMP_SPINCOUNT = EnvVar(
    "GOMP_SPINCOUNT",
    "How many times an idle OpenMP thread spins (about 20 ns each) before it sleeps. cadenza sets 10000 "
    "unless this or OMP_WAIT_POLICY is set; libgomp's own default is 300000.",
    "10000",
)
# OpenMP's thread binding: where any is set, `model.thread_binding: auto` pins nothing and leaves
# placement to the OpenMP runtime (threads/binding.py).
OMP_PROC_BIND = EnvVar("OMP_PROC_BIND", "OpenMP's own thread binding (true, spread, close); when set, thread_binding auto pins nothing.", "false")
OMP_PLACES = EnvVar("OMP_PLACES", "OpenMP's places for bound threads (cores, threads); when set, thread_binding auto pins nothing.", "cores")
GOMP_CPU_AFFINITY = EnvVar("GOMP_CPU_AFFINITY", "libgomp's CPU list for its threads; when set, thread_binding auto pins nothing.", "0")
KMP_AFFINITY = EnvVar("KMP_AFFINITY", "Intel OpenMP's thread binding; when set, thread_binding auto pins nothing.", "disabled")

ALL: tuple[EnvVar, ...] = (CONFIG, PLUGINS, CPU, CPU_ISA, LLAMACPP_HOME, PARALLEL_CONFIG, REPLICA_CONFIG, REPLICA_INDEX, REPLICA_HOST,
                           OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY, KMP_AFFINITY)
NAMES = frozenset(v.name for v in ALL)
