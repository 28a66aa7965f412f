"""The CPU itself: `cpu_kinds` (cadenza against llama.cpp's binaries as each CPU kind this machine can
act as, `CADENZA_CPU`) and `share_cores` (the engine beside a busy neighbour, per thread binding).

Imports: `common/` and `peers/` (llama.cpp's binaries).
"""
