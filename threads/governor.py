"""`model.thread_policy: adaptive`: a smaller OpenMP team while other processes keep the cores busy.

A step's team meets at about 180 barriers (every product, norm and attention call). Beside a busy
neighbour one of its threads is often off its core, and the others wait at the next barrier until
the scheduler brings it back: docs/cpu-threads.md measured 16 requests beside a 2-process hog at
2.8x their time alone with 2 threads (the median; one run in three 4.9x) and a steady 2.4x with 1.
So every `INTERVAL` seconds, before a step, the compute thread reads how busy the machine's CPUs
were (/proc/stat) against this process's own time (/proc/self/stat), and sizes the team to the
cores the others left: `threads - round(others)`, at least 1, back to `threads` once they go quiet.

Off by default: torch's own float GEMMs may round differently with another team size (cadenza's
kernels do not: each output is one thread's). Linux only; elsewhere the team stays as configured.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import structlog

from cadenza.threads.cpu_time import CpuSnapshot, take_snapshot

log = structlog.get_logger(__name__)

INTERVAL = 0.5  # seconds between looks: long enough to average a scheduler's slices, short enough to follow a neighbour
QUIET_BELOW = 0.5  # others' cores under this count as none (kernel threads, a shell, a light neighbour)
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def team_size(threads: int, others: float) -> int:
    """The team for `threads` configured when other processes kept `others` cores busy."""
    if others < QUIET_BELOW:
        return threads
    return max(1, threads - max(1, round(others)))


class ThreadGovernor:
    """Resizes the calling thread's OpenMP team (`set_threads`) from what other processes use.
    `before_step` runs on the compute thread, before each model step."""

    def __init__(self, threads: int, *, interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], CpuSnapshot | None] = take_snapshot, set_threads: Callable[[int], None] | None = None,
                 ticks_per_second: float = TICKS) -> None:  # fmt: skip
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.threads = self.current = threads
        self.interval, self.clock, self.sample, self.set_threads = interval, clock, sample, set_threads
        self.ticks_per_second = ticks_per_second
        self._last: tuple[float, CpuSnapshot] | None = None
        self.others = 0.0  # cores the other processes kept busy over the last interval

    def before_step(self) -> None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return
        snapshot = self.sample()
        if snapshot is None:
            return  # no /proc here: the team stays as it is
        if self._last is not None:
            then, before = self._last
            others = (snapshot.busy - before.busy) - (snapshot.own - before.own)
            self.others = max(0.0, others) / self.ticks_per_second / (now - then)
            wanted = team_size(self.threads, self.others)
            if wanted != self.current:
                self.set_threads(wanted)
                log.info("Threads resized to the cores other processes leave", threads=wanted,
                         configured=self.threads, others_busy_cores=round(self.others, 2))  # fmt: skip
                self.current = wanted
        self._last = (now, snapshot)


def thread_governor(runtime) -> ThreadGovernor | None:
    """The governor `model.thread_policy: adaptive` asks for, sized from the compute thread's own
    team: one engine on the CPU (not a tensor-parallel rank 0, whose workers keep their teams).
    None otherwise."""
    if runtime.config.model.thread_policy != "adaptive" or runtime.parallel is not None:
        return None
    if runtime.runner.device.type != "cpu":
        return None
    import torch

    from cadenza.threads import compute_thread

    return ThreadGovernor(compute_thread.run_sync(torch.get_num_threads))
