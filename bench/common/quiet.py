"""Is the machine quiet? Other processes' share of the CPU, read from /proc, before and during a run.

On a small shared machine another process can slow a run 4-20x. `other_cpu_share` (threads/cpu_time.py)
is the busy jiffies of the whole machine minus this process's own (all its threads), over the
interval, as a fraction of all CPUs' time: 0.5 on two cores means another process kept one core busy.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from cadenza.threads import compute_thread
from cadenza.threads.cpu_time import CpuSnapshot, other_cpu_share, take_snapshot  # noqa: F401 (the bench's names)

T = TypeVar("T")


def measure_other_cpu(seconds: float) -> float | None:
    before = take_snapshot()
    time.sleep(seconds)
    return other_cpu_share(before, take_snapshot())


@dataclass(slots=True)
class QuietPolicy:
    """Thresholds and bounds: a run is quiet when others used under `threshold` of the CPU."""

    threshold: float = 0.05
    probe_seconds: float = 0.5  # how long the check before a run watches an idle machine
    max_wait_seconds: float = 30.0  # how long to wait for a busy machine to calm before a run
    max_repeats: int = 2  # how many times a disturbed run is repeated
    enabled: bool = True


@dataclass(slots=True)
class QuietReport:
    """What the machine did around one measurement (the kept attempt, and how many there were)."""

    other_share: float | None  # during the kept attempt
    before_share: float | None
    attempts: int = 1
    waited_seconds: float = 0.0
    shares: list[float | None] = field(default_factory=list)
    threshold: float = 0.05

    @property
    def is_quiet(self) -> bool | None:
        if self.other_share is None:
            return None
        return self.other_share < self.threshold

    def describe(self) -> str:
        if self.other_share is None:
            return "quiet: unknown (no /proc/stat)"
        repeats = self.attempts - 1
        suffix = f", repeated {repeats}x" if repeats else ""
        if self.waited_seconds >= 1:
            suffix += f", waited {self.waited_seconds:.0f}s"
        if self.is_quiet:
            return f"quiet: yes ({100 * self.other_share:.1f}% other CPU{suffix})"
        return f"disturbed: {100 * self.other_share:.0f}% other CPU{suffix}"

    def as_dict(self) -> dict:
        return {
            "quiet": self.is_quiet,
            "other_cpu_share": self.other_share,
            "before_other_cpu_share": self.before_share,
            "attempts": self.attempts,
            "attempt_shares": self.shares,
            "waited_seconds": round(self.waited_seconds, 2),
            "summary": self.describe(),
        }


def wait_for_quiet(policy: QuietPolicy) -> tuple[float | None, float]:
    """Probe until others use under the threshold, for at most `max_wait_seconds`.

    Returns the last probe's share and the seconds spent waiting beyond the first probe.
    """
    started = time.monotonic()
    share = measure_other_cpu(policy.probe_seconds)
    while share is not None and share >= policy.threshold and time.monotonic() - started < policy.max_wait_seconds:
        time.sleep(1.0)
        share = measure_other_cpu(policy.probe_seconds)
    return share, max(0.0, time.monotonic() - started - policy.probe_seconds)


def run_quietly(
    fn: Callable[[], T],
    policy: QuietPolicy | None = None,
    *,
    on_compute_thread: bool = True,
    snapshot: Callable[[], CpuSnapshot | None] = take_snapshot,
) -> tuple[T, QuietReport]:
    """Run `fn` on a quiet machine; repeat a disturbed run up to `max_repeats` times.

    Keeps the least disturbed attempt's result. The report says what happened, so a disturbed
    number is never passed off as a quiet one. `fn` runs on the compute thread unless
    `on_compute_thread` is False; `snapshot` decides which CPU time counts as the run's own (a
    serving bench counts its server's too). With the policy disabled, `fn` runs once, unwaited.
    """
    policy = policy or QuietPolicy()
    best: tuple[T, float | None, float | None] | None = None
    shares: list[float | None] = []
    waited = 0.0
    for _ in range(policy.max_repeats + 1 if policy.enabled else 1):
        before_share = None
        if policy.enabled:
            before_share, wait = wait_for_quiet(policy)
            waited += wait
        start = snapshot()
        result = compute_thread.run_sync(fn) if on_compute_thread else fn()
        share = other_cpu_share(start, snapshot())
        shares.append(share)
        if best is None or (share is not None and (best[1] is None or share < best[1])):
            best = (result, share, before_share)
        if share is None or share < policy.threshold:
            break
    assert best is not None
    result, share, before_share = best
    return result, QuietReport(share, before_share, len(shares), waited, shares, policy.threshold)


def describe_machine() -> str:
    cpus = os.cpu_count() or 0
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{cpus} CPUs{', ' + model if model else ''}"
