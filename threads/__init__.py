"""The CPU's threads: the one compute thread all of torch's heavy work runs on
(`compute_thread.py`), its OpenMP team pinned one thread a core (`binding.py`), sized to the
cores other processes leave (`governor.py`), and the machine's CPU time against the process's own
(`cpu_time.py`).

Costs nothing to import (no torch at import time). May import: config/ and the root's plain
data only; what it needs from the kernels (pinning threads) is passed in by the engine.
"""
