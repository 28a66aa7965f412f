"""The machine's CPU time against this process's own, read from /proc (Linux): how much of the CPU
other processes kept busy. The benchmarks' quiet check (bench/common/quiet.py) and the adaptive thread
team (threads/governor.py) both read it. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass

PROC_STAT = "/proc/stat"
PROC_SELF_STAT = "/proc/self/stat"


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    total: int  # jiffies of all CPUs, idle included
    busy: int  # jiffies of all CPUs spent running anything
    own: int  # jiffies this process (every thread) and its waited-for children have run


def take_snapshot(stat: str = PROC_STAT, self_stat: str = PROC_SELF_STAT) -> CpuSnapshot | None:
    """None where /proc is not there (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open(self_stat) as f:
            own_fields = f.read().rsplit(")", 1)[1].split()  # the command may hold spaces and ')'
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user).
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    # After the ")" of comm: field 3 is the state, so utime and stime are the 12th and 13th, and
    # cutime and cstime (children waited for: a peer's binary the bench ran) the 14th and 15th.
    own = sum(int(own_fields[i]) for i in (11, 12, 13, 14))
    return CpuSnapshot(total=busy + idle + iowait, busy=busy, own=own)


def other_cpu_share(before: CpuSnapshot | None, after: CpuSnapshot | None) -> float | None:
    """Other processes' busy time over the interval, as a fraction of all CPUs' time: 0.5 on two
    cores means another process kept one core busy. None when either snapshot is missing."""
    if before is None or after is None or after.total <= before.total:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / (after.total - before.total))
