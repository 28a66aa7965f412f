"""Sharing the cores (docs/cpu-threads.md): `import cadenza` bounds how long OpenMP's idle threads
spin, unless the user chose; that bound reaches the OpenMP runtime torch loads afterwards; and an
idle engine uses no CPU. Each case runs in a child process, since libgomp reads its variables once,
when torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cadenza.config import environment
from cadenza.threads import compute_thread

SPIN, POLICY = environment.GOMP_SPINCOUNT.name, environment.OMP_WAIT_POLICY.name


def _child(code: str, **env: str | None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in (SPIN, POLICY)}
    environ.update({k: v for k, v in env.items() if v is not None})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {SPIN: compute_thread.DEFAULT_SPIN_COUNT, POLICY: None}),
        ({SPIN: "12345"}, {SPIN: "12345", POLICY: None}),
        ({POLICY: "ACTIVE"}, {SPIN: None, POLICY: "ACTIVE"}),
        ({POLICY: "passive"}, {SPIN: None, POLICY: "passive"}),
    ],
    ids=["unset", "own-spin-count", "own-policy-active", "own-policy-passive"],
)
def test_import_cadenza_bounds_the_spin_unless_the_user_chose(given, expected):
    got = _child(f"import json, os, sys, cadenza; print(json.dumps({{k: os.environ.get(k) for k in {[SPIN, POLICY]!r}}}))", **given)
    assert got == expected


# After a parallel region, how much CPU torch's other OpenMP threads use in the next 0.2 s: they
# spin (about 20 ns a spin on a 2-core Xeon), then sleep.
_AFTER_A_REGION = """
    import json, os, threading, time
    import cadenza
    import torch

    def ran_ns():
        total = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != threading.get_native_id():
                try:
                    total += int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
                except OSError:
                    pass
        return total

    torch.set_num_threads(2)
    x = torch.ones(1 << 22)
    for _ in range(20):
        x.mul_(1.0)  # a parallel region (over ATen's grain size): the team starts, then is reused
    x.mul_(1.0)
    before = ran_ns()
    time.sleep(0.2)
    print(json.dumps({"ms": (ran_ns() - before) / 1e6, "threads": len(os.listdir("/proc/self/task"))}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's per-thread schedstat and 2 CPUs")  # fmt: skip
def test_openmp_threads_sleep_soon_after_a_region():
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP")
    bounded = _child(_AFTER_A_REGION)
    spinning = _child(_AFTER_A_REGION, **{POLICY: "ACTIVE"})  # the check can see a spinning thread
    assert bounded["threads"] > 1 and spinning["threads"] > 1, "torch started no OpenMP worker"
    # 3000 spins: well under a millisecond here; ACTIVE spins for the whole 200 ms (libgomp's own
    # default, 300,000 spins, about 6 ms).
    assert bounded["ms"] < 3, bounded
    assert spinning["ms"] > 20, spinning


def test_an_idle_engine_uses_no_cpu(model_path):
    got = _child(f"""
        import json, os, time
        from cadenza.llm import LLM
        from cadenza.sampling_params import SamplingParams

        def cpu_seconds():
            fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        with LLM({str(model_path)!r}, **{{"logging.level": "warning"}}) as llm:
            llm.generate(["hello", "world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            time.sleep(0.2)  # the last step's spinning threads have gone to sleep
            before = cpu_seconds()
            time.sleep(2.0)
            print(json.dumps({{"cpu": cpu_seconds() - before}}))
    """)
    # Nothing polls while no request runs: the event loop, the actors and the compute thread wait
    # on their queues, OpenMP's threads sleep. A bound of 10% of one core, for a noisy machine.
    assert got["cpu"] < 0.2, got


# --- model.thread_policy: adaptive (threads/governor.py) ---------------------------------------------


def test_the_team_gives_back_the_cores_others_keep_busy():
    from cadenza.threads.governor import team_size

    assert [team_size(2, others) for others in (0.0, 0.3, 0.6, 1.0, 1.4, 2.0)] == [2, 2, 1, 1, 1, 1]
    assert [team_size(8, others) for others in (0.1, 0.7, 2.6, 9.0)] == [8, 7, 5, 1]


def test_the_governor_resizes_from_the_cpu_others_used_and_comes_back():
    from cadenza.threads.cpu_time import CpuSnapshot
    from cadenza.threads.governor import ThreadGovernor

    now, ticks, calls = [0.0], [CpuSnapshot(0, 0, 0)], []
    governor = ThreadGovernor(2, interval=0.5, clock=lambda: now[0], sample=lambda: ticks[0],
                              set_threads=calls.append, ticks_per_second=100)  # fmt: skip

    def step_after(seconds: float, machine_busy: int, ours: int) -> None:
        now[0] += seconds
        last = ticks[0]
        ticks[0] = CpuSnapshot(last.total + 200, last.busy + machine_busy, last.own + ours)
        governor.before_step()

    governor.before_step()  # the first look only takes a sample
    step_after(1.0, 200, 100)  # we used 1 core of 2 busy ones: others kept 1 core busy
    assert (calls, governor.current, governor.others) == ([1], 1, 1.0)
    step_after(0.2, 40, 10)  # within the interval: no look
    step_after(0.4, 120, 60)  # others still at ~1 core: no change
    assert calls == [1]
    step_after(1.0, 100, 100)  # the neighbour stopped: all the busy time is ours
    assert (calls, governor.current) == ([1, 2], 2)


def test_a_cpu_snapshot_reads_the_machine_s_busy_time_and_its_own(tmp_path):
    from cadenza.threads.cpu_time import CpuSnapshot, take_snapshot

    stat, own = tmp_path / "stat", tmp_path / "self_stat"
    stat.write_text("cpu  100 5 30 900 7 1 2 3 0 0\ncpu0 50 2 15 450 3 0 1 1 0 0\n")
    own.write_text("4242 (a (strange) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 17 4 2 1 20 0 3 0\n")
    busy = 100 + 5 + 30 + 1 + 2 + 3
    assert take_snapshot(str(stat), str(own)) == CpuSnapshot(total=busy + 900 + 7, busy=busy, own=17 + 4 + 2 + 1)
    assert take_snapshot(str(tmp_path / "absent"), str(own)) is None
    assert take_snapshot().busy > 0  # this machine's own /proc


def test_an_adaptive_engine_builds_its_governor_and_gives_the_same_tokens(model_path):
    from cadenza.llm import LLM
    from cadenza.sampling_params import SamplingParams
    from cadenza.threads import compute_thread

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for policy in ("fixed", "adaptive"):
        with LLM(str(model_path), **{"logging.level": "warning", "model.thread_policy": policy}) as llm:
            runner = next(a for a in llm.engine.actors if a.name == "runner")
            assert (runner.governor is None) == (policy == "fixed")
            outputs[policy] = [o.outputs[0].token_ids for o in llm.generate(["hello", "world"], params)]
            if runner.governor is not None:
                compute_thread.run_sync(lambda: runner.governor.set_threads(runner.governor.threads))
    assert outputs["fixed"] == outputs["adaptive"]
