"""`model.thread_binding`: each thread of the compute thread's OpenMP team on a core of its own.

Left to the OS, the team's two threads on a 2-core machine beside a busy 2-process neighbour
settle, in about one process in three, on the *same* core (2 runnable threads a core looks balanced
to the scheduler, so nothing moves them): each barrier then waits for the partner to be scheduled
on the core the waiter is spinning on, and 16 requests took 1.5-2.6 s instead of 1.3 (sampled
placement in docs/cpu-threads.md: the slow runs had both threads on one CPU in 40-90% of samples,
the fast ones in under 10%). Pinned one thread a core, the neighbour's processes are the ones that
get balanced, one a core, and every run took 1.25-1.34 s.

`auto` (the default) pins only where the team is this process's to place: one engine on the CPU
(not a tensor-parallel rank or a data-parallel replica, which share the cores out), a team of two
or more threads covering exactly the cores (or the logical CPUs) the process may run on, a team
the thread governor does not resize (`thread_policy: fixed`: shrunk to one thread beside a busy
neighbour, a pinned thread would share its one core instead of taking two thirds of a core's
time across both), and no OpenMP binding variable set by the user (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY,
KMP_AFFINITY: theirs wins). `none` leaves placement to the OS. A CPU list ("0-3", "0,2,4,6")
pins thread i to its i-th CPU whatever the team's size, as vLLM's `VLLM_CPU_OMP_THREADS_BIND` does
(refused with `thread_policy: adaptive`: a team regrown after shrinking gets new threads, which
inherit thread 0's one CPU). Pinning needs cadenza's CPU kernels (a thread can only set its own
mask; the kernels run the parallel region in which each team thread does), and is undone when the
engine stops (the compute thread outlives it, and what it starts next inherits its mask).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import structlog

from cadenza.config import environment
from cadenza.config.errors import ConfigError
from cadenza.config.schema import parse_cpu_list

log = structlog.get_logger(__name__)

SYS_CPU = Path("/sys/devices/system/cpu")
USER_BINDING = (environment.OMP_PROC_BIND, environment.OMP_PLACES, environment.GOMP_CPU_AFFINITY, environment.KMP_AFFINITY)


def one_cpu_per_core(cpus: list[int], sys_cpu: Path = SYS_CPU) -> list[int]:
    """The first of `cpus` on each physical core (SMT siblings share one: the same
    `thread_siblings_list`), in `cpus`' order; `cpus` itself where the topology cannot be read."""
    seen: set[str] = set()
    first: list[int] = []
    for cpu in cpus:
        try:
            siblings = (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            return list(cpus)
        if siblings not in seen:
            seen.add(siblings)
            first.append(cpu)
    return first


def plan_binding(setting: str, threads: int, allowed: list[int], cores: list[int],
                 environ: Mapping[str, str] = os.environ, *, adaptive: bool = False) -> tuple[list[int] | None, str]:  # fmt: skip
    """The CPU of each team thread (None: leave placement to the OS) and why, for a team of
    `threads` in a process allowed `allowed` CPUs, `cores` of them one per physical core;
    `adaptive`: the thread governor resizes the team (`model.thread_policy: adaptive`)."""
    if setting == "none":
        return None, "model.thread_binding is none"
    if setting != "auto":
        if adaptive:  # a team regrown after shrinking gets new threads, which inherit thread 0's one CPU
            raise ConfigError("model.thread_binding: a CPU list pins a fixed team; thread_policy adaptive resizes it")
        cpus = parse_cpu_list(setting)
        outside = [cpu for cpu in cpus if cpu not in allowed]
        if outside:
            raise ConfigError(f"model.thread_binding: CPUs {outside} are not ones this process may run on ({allowed})")
        if len(cpus) < threads:
            raise ConfigError(f"model.thread_binding: {len(cpus)} CPUs for a team of {threads} threads "
                              "(list one CPU a thread, or lower model.num_threads)")  # fmt: skip
        return cpus[:threads], "model.thread_binding lists them"
    if adaptive:
        return None, "thread_policy adaptive resizes the team: a lone thread pinned would get one core's share, not two thirds"
    chosen = [v.name for v in USER_BINDING if v.name in environ]
    if chosen:
        return None, f"{', '.join(chosen)} set: OpenMP places the threads"
    if threads < 2:
        return None, "one thread: nothing to keep apart"
    if threads == len(cores):
        return cores, "one thread a core"
    if threads == len(allowed):
        return list(allowed), "one thread a logical CPU"
    return None, f"{threads} threads for {len(cores)} cores: the team does not cover this process's cores"


@dataclass(frozen=True, slots=True)
class TeamPlan:
    """Where the compute thread's team goes, decided when the runtime is built: `cpus`, one a
    thread (None: where the OS puts them), and why."""

    cpus: tuple[int, ...] | None
    reason: str
    listed: bool  # the user listed the CPUs (a list that cannot be applied is worth a warning)


def plan_compute_team(config, parallel, device) -> TeamPlan:
    """`model.thread_binding` for the calling thread's team (the compute thread's, at build time),
    so that a list it cannot hold is a config error before anything serves. One engine on the CPU
    only: a tensor-parallel rank 0 (`parallel`) keeps the OS's placement."""
    setting = config.model.thread_binding
    listed = setting not in ("auto", "none")
    if device.type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return TeamPlan(None, "not on the CPU", listed)
    if parallel is not None:
        return TeamPlan(None, "tensor-parallel ranks share the CPUs out", listed)
    import torch

    allowed = sorted(os.sched_getaffinity(os.getpid()))  # the main thread's: the process's own CPUs
    cpus, why = plan_binding(setting, torch.get_num_threads(), allowed, one_cpu_per_core(allowed),
                             adaptive=config.model.thread_policy == "adaptive")  # fmt: skip
    return TeamPlan(None if cpus is None else tuple(cpus), why, listed)


# This process's pinned compute team: the kernels that pinned it and the CPUs to give back.
_pinned: tuple[object, list[int]] | None = None


def bind_compute_team(plan: TeamPlan | None, load_kernels: Callable[[], Any]) -> tuple[int, ...] | None:
    """Pin the compute thread's team as `plan` (the runtime's `team_plan`) says; the CPUs, or None
    when the threads stay where the OS puts them (a team an earlier engine pinned is released).
    `load_kernels()` gives the CPU kernels that pin threads, or None where they are unavailable:
    passed in, as this layer sits below the kernels."""
    global _pinned
    if plan is None or plan.cpus is None:
        release_compute_team()
        if plan is not None:
            (log.warning if plan.listed else log.debug)("Threads left to the OS", reason=plan.reason)
        return None
    from cadenza.threads import compute_thread

    kernels = load_kernels()
    if kernels is None:
        (log.warning if plan.listed else log.info)("Threads left to the OS", reason="pinning them needs cadenza's CPU kernels")
        return None
    cpus = plan.cpus
    pinned = compute_thread.run_sync(lambda: kernels.set_team_affinity([[cpu] for cpu in cpus]))
    _pinned = (kernels, sorted(os.sched_getaffinity(os.getpid())))
    if pinned < len(cpus):
        log.warning("Some threads could not be pinned", cpus=list(cpus), pinned=pinned)
    log.info("Threads pinned", cpus=list(cpus), reason=plan.reason)
    return cpus


def release_compute_team() -> None:
    """Give the compute thread's team the process's CPUs back, if an engine pinned it: the compute
    thread lives as long as the process, and a pin would outlive the engine, in the team and in
    every thread and process the compute thread starts later (a tensor-parallel rank, say)."""
    global _pinned
    if _pinned is None:
        return
    import torch

    from cadenza.threads import compute_thread

    kernels, allowed = _pinned
    _pinned = None
    compute_thread.run_sync(lambda: kernels.set_team_affinity([allowed] * torch.get_num_threads()))
