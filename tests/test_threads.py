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

from cadenza import compute_thread, environment

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
